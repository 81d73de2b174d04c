"""The bounded pool that tokenizes prompts and renders chat templates for the front door.

Each worker is a process (cluster/frontend/render_worker.py), not a thread, for two reasons
measured here: the `tokenizers` library holds the GIL while it encodes (a 5 MB prompt froze
every other thread of the server for 4 s), and a runaway jinja loop in a thread can never be
stopped (two of them kept a thread pool busy past every deadline and SIGTERM). A job that
runs past `timeout_s` (or whose caller is cancelled: the client went away or its deadline
passed) gets its worker killed and replaced, so the pool is full again within a worker's
start-up time (about 0.3 s), and one client's request delays others by at most `timeout_s`
even with every worker busy. Stopping the server kills the workers; a worker also dies with
its parent (Linux).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from kvloom.cluster.frontend.errors import FrontendError, InvalidArgument, RenderTimeout
from kvloom.cluster.frontend.render_worker import HEADER, READY

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a worker's start-up: Python, the tokenizer, the chat template


def _import_root() -> str:
    """The directory `import kvloom` resolves from here (a checkout or site-packages)."""
    import kvloom

    return str(Path(kvloom.__file__).resolve().parent.parent)


class WorkerFailed(FrontendError):
    """A render worker exited or broke its protocol (logged; the pool replaces it)."""


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    async def call(self, job: tuple[str, tuple]) -> Any:
        data = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(HEADER.pack(len(data)) + data)
            await self.process.stdin.drain()
        except ConnectionError:  # it died since its last job
            code = await self.process.wait()
            raise WorkerFailed(f"a render worker exited (status {code})") from None
        return await self.reply()

    @property
    def exited(self) -> bool:
        return self.process.returncode is not None

    async def reply(self) -> Any:
        assert self.process.stdout is not None
        try:
            (size,) = HEADER.unpack(await self.process.stdout.readexactly(HEADER.size))
            return pickle.loads(await self.process.stdout.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            code = await self.process.wait()
            raise WorkerFailed(f"a render worker exited (status {code})") from None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()


class RenderPool:
    """`size` worker processes for one model directory; use from one event loop."""

    def __init__(self, model_dir: str, size: int = 2, timeout_s: float = 10.0) -> None:
        self.model_dir = str(model_dir)
        self.size = size
        self.timeout_s = timeout_s
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._workers: set[_Worker] = set()
        self._spawning: set[asyncio.Task] = set()
        self._closed = False
        self.num_replaced = 0

    # ----- life cycle

    async def start(self) -> None:
        """Starts every worker; raises (with the worker's reason) if one cannot start."""
        workers = await asyncio.gather(
            *(self._spawn() for _ in range(self.size)), return_exceptions=True
        )
        failed = [w for w in workers if isinstance(w, BaseException)]
        for worker in workers:
            if isinstance(worker, _Worker):
                self._idle.put_nowait(worker)
        if failed:
            await self.close()
            raise failed[0]

    async def _spawn(self) -> _Worker:
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_import_root(), env.get("PYTHONPATH")]))
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvloom.cluster.frontend.render_worker",
            self.model_dir,
            str(os.getpid()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        worker = _Worker(process)
        self._workers.add(worker)
        try:
            kind, detail = await asyncio.wait_for(worker.reply(), START_TIMEOUT_S)
            if kind != READY:
                raise RuntimeError(f"a render worker could not load {self.model_dir}: {detail}")
        except BaseException:
            await self._discard(worker)
            raise
        return worker

    def _replace(self, worker: _Worker) -> None:
        """Kills a worker (its job overran or was abandoned) and starts another in its place."""
        worker.kill()
        task = asyncio.get_running_loop().create_task(self._respawn(worker))
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def _respawn(self, old: _Worker) -> None:
        await self._discard(old)
        if self._closed:
            return
        try:
            worker = await self._spawn()
        except Exception:
            logger.exception("could not restart a render worker; the pool has one fewer")
            return
        if self._closed:
            await self._discard(worker)
            return
        self.num_replaced += 1
        self._idle.put_nowait(worker)

    async def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with contextlib.suppress(ProcessLookupError):
            await worker.process.wait()
        self._workers.discard(worker)

    async def close(self) -> None:
        """Kills every worker at once, whatever it is doing."""
        self._closed = True
        for task in list(self._spawning):
            task.cancel()
        for worker in list(self._workers):
            worker.kill()
        await asyncio.gather(
            *(self._discard(w) for w in list(self._workers)), *self._spawning,
            return_exceptions=True,
        )  # fmt: skip

    def stats(self) -> dict[str, int]:
        return {
            "size": self.size,
            "alive": len(self._workers),
            "idle": self._idle.qsize(),
            "replaced": self.num_replaced,
        }

    # ----- jobs

    async def _run(self, name: str, args: tuple, field: str, what: str) -> Any:
        if self._closed:
            raise WorkerFailed("the render pool is stopped")
        worker = await self._idle.get()  # cancelled while waiting: nothing was taken
        while worker.exited:  # died while idle (killed from outside): replace it, take another
            logger.error("a render worker exited while idle (status %s)", worker.process.returncode)
            self._replace(worker)
            worker = await self._idle.get()
        try:
            kind, result = await asyncio.wait_for(worker.call((name, args)), self.timeout_s)
        except TimeoutError:
            self._replace(worker)
            raise RenderTimeout(
                field, f"{what} took longer than the server's limit ({self.timeout_s:g} s)"
            ) from None
        except asyncio.CancelledError:
            self._replace(worker)
            raise
        except WorkerFailed as exc:
            logger.error("%s while %s", exc, what)
            self._replace(worker)
            raise WorkerFailed(f"{field}: {exc} while {what}") from None
        except BaseException:
            self._replace(worker)
            raise
        self._idle.put_nowait(worker)
        if kind == "invalid":
            raise InvalidArgument.from_message(result, field)
        if kind != "ok":
            raise WorkerFailed(f"{field}: {what} failed: {result}")
        return result

    async def encode(self, text: str, add_special_tokens: bool, field: str = "text") -> list[int]:
        return await self._run("encode", (text, add_special_tokens), field, "tokenizing")

    async def decode(
        self, ids: list[int], skip_special_tokens: bool, field: str = "token_ids"
    ) -> str:
        return await self._run("decode", (ids, skip_special_tokens), field, "detokenizing")

    async def render(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        template_kwargs: dict,
        add_generation_prompt: bool,
        continue_final_message: bool,
    ) -> tuple[str, list[int]]:
        """The rendered chat prompt and its token ids."""
        args = (messages, tools, template_kwargs, add_generation_prompt, continue_final_message)
        return await self._run("render", args, "messages", "rendering the chat template")
