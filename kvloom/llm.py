"""The offline API: `LLM(model=...).generate(prompts, params)`, as vLLM users know it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from kvloom.cluster.chat_template import ChatTemplate
from kvloom.cluster.engine import Engine, PromptInput
from kvloom.cluster.engine_channel import RequestError
from kvloom.cluster.outputs import RequestOutput
from kvloom.cluster.structured_outputs.tool_call_grammar import (
    default_tool_call_parser,
    forced_tool_choice,
    tool_choice_constraint,
)
from kvloom.cluster.tokenizer import Tokenizer
from kvloom.contracts.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, progress: bool = True, **kwargs: Any):
        """`data_parallel_size=N` (vLLM's name) runs N replicas on Ray, each its own
        scheduler actor and TP × DCP grid, with requests routed between them as
        `kvloom serve --data-parallel-size` does (`routing=` picks the policy)."""
        if kwargs.get("data_parallel_size", 1) != 1 or "routing" in kwargs:
            from kvloom.cluster.frontend.engine_builder import build_engine

            self.engine = build_engine(progress=progress, model=model, **kwargs)
        else:
            kwargs.pop("data_parallel_size", None)
            self.engine = Engine(model=model, progress=progress, **kwargs)
        self._chat_template: ChatTemplate | None = None
        self._tokenizer = getattr(self.engine, "tokenizer", None)

    def get_tokenizer(self):
        if self._tokenizer is None:  # replicas tokenize in their own actors
            self._tokenizer = Tokenizer(self.engine.config.model.model)
        return self._tokenizer

    def shutdown(self) -> None:
        """Frees the engine's workers (and, with replicas, their Ray actors)."""
        self.engine.shutdown()

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        tool_call_parser: str | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered with the model's chat
        template (its BOS included; tools given to the template) and generated as
        `generate` does. The outputs' text is the raw completion, as vLLM's.

        `tool_choice` as OpenAI's: "auto" (or None), "none" (the tools are not rendered),
        "required" or {"type": "function", "function": {"name": ...}}; the last two are
        enforced by a grammar of the calls in `tool_call_parser`'s format (by default the
        one the server would pick for this model; docs/structured_outputs.md).
        `parallel_tool_calls=False` makes "required" exactly one call."""
        conversations = (
            [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        )
        template = self._template()
        tools, forced = forced_tool_choice(tools, tool_choice)
        if forced is not None:
            sampling_params = self._constrain_to_tools(
                sampling_params, tools, forced, tool_call_parser, parallel_tool_calls
            )
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            rendered = template.render(
                conversation,
                tools,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
            ids = tokenizer.encode(rendered.text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _constrain_to_tools(self, sampling_params, tools, forced, tool_call_parser, parallel):
        parser = tool_call_parser or default_tool_call_parser(
            self.engine.config.model.model, self._template()
        )
        if parser is None:
            raise ValueError(
                "tool_call_parser: no known tool-call format for this model; name one "
                "to force tool_choice"
            )
        named = None if forced is True else forced
        constraint = tool_choice_constraint(parser, tools, named, parallel=parallel)
        params = sampling_params or SamplingParams()
        many = isinstance(params, list)
        constrained = []
        for p in params if many else [params]:
            if p.structured_outputs is not None:
                raise ValueError(
                    "tool_choice: a forced tool choice cannot be combined with structured outputs"
                )
            constrained.append(replace(p, structured_outputs=constraint))
        return constrained if many else constrained[0]

    def _template(self) -> ChatTemplate:
        if self._chat_template is None:
            model_dir = self.engine.config.model.model
            template = ChatTemplate.from_model_dir(model_dir)
            if template is None:
                raise ValueError(
                    f"messages: the model {model_dir} has no chat template "
                    "(tokenizer_config.json chat_template or chat_template.jinja)"
                )
            self._chat_template = template
        return self._chat_template

    def generate(
        self,
        prompts: PromptInput | list[PromptInput],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order (a progress
        bar on stderr unless `use_tqdm=False`, as vLLM's)."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params: one per prompt, or a single one for all")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                rid = self.engine.next_request_id()
                # Only finished outputs are read here: skip building the others each step.
                self.engine.add_request(rid, prompt, replace(p, output_kind="final_only"))
                ids.append(rid)
        except ValueError:
            self.engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if isinstance(out, RequestError):  # e.g. a grammar that does not compile
                    self.engine.abort_request(ids)
                    bar.close()
                    raise ValueError(out.message)
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[rid] for rid in ids]
