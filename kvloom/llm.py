"""The offline API: `LLM(model=...).generate(prompts, params)`, as vLLM users know it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tqdm import tqdm

from kvloom.cluster.engine import Engine, PromptInput
from kvloom.cluster.outputs import RequestOutput
from kvloom.contracts.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, progress: bool = True, **kwargs: Any):
        self.engine = Engine(model=model, progress=progress, **kwargs)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | list[PromptInput],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order."""
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
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[rid] for rid in ids]
