"""The OpenAI-compatible HTTP front door (`kvloom serve --http-port`), beside gRPC.

It is a second face of the same front door, not a second server: an OpenAI request is
decoded and checked (body.py, request_models.py), turned into the gRPC door's own request
message (to_proto.py), and started by the same GenerationServicer (validation, chat template,
tokenizer pool, engine, stop strings, reasoning and tool-call parsers); the stream's messages
come back as OpenAI objects and server-sent events (openai_output.py). So a request gives the
same tokens through either door. routes.py is the FastAPI app, listener.py runs it in
uvicorn on the server's own event loop (the --metrics-port server too).
"""

from kvloom.cluster.frontend.http.listener import HttpListener
from kvloom.cluster.frontend.http.routes import build_app, build_metrics_app

__all__ = ["HttpListener", "build_app", "build_metrics_app"]
