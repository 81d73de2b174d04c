"""`placement: "remote"` for drafters that read the target's hidden states: EAGLE-3 and
DFlash (auxiliary states captured on the worker, shipped per step) and MTP (final hidden
states; the actor loads the target checkpoint's own `mtp.*` layer). Greedy tokens equal no
speculation (also at TP 2 with async scheduling) and, at TP 1, the drafts are exactly the
in-process drafter's (so the shipped states are the ones it would have read); the worker
hooks the target where the drafter says; an EAGLE-3 drafter killed mid-run leaves every request finishing with the right tokens and drafts again once
Ray restarted it; the messages carry only kept tokens' rows."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvloom import Engine
from kvloom.workers.spec_decode.dflash import write_dflash_head
from kvloom.workers.spec_decode.eagle3 import write_eagle3_head
from kvloom.workers.spec_decode.mtp import write_mtp_checkpoint
from tests.engine_helpers import greedy, run_to_completion
from tests.test_remote_drafter import TIGHT_POOL, assert_preempted_and_hit, shared_prefix_tokens
from tests.test_spec_decode_engine import record_steps, repetitive_prompts

pytestmark = pytest.mark.slow

PROMPTS = repetitive_prompts(3)
MAX_TOKENS = 12
SETTINGS = dict(num_kv_blocks=120, max_num_batched_tokens=16, max_model_len=256)


def make_engine(path, spec=None, block_size=4, **kw) -> Engine:
    return Engine(
        model=str(path),
        dtype="float64",
        device="cpu",
        progress=False,
        speculative_config=spec,
        block_size=block_size,
        **{**SETTINGS, **kw},
    )


def spec_of(method: str, model, placement: str = "local", k: int = 3) -> dict:
    spec = {"method": method, "num_speculative_tokens": k, "placement": placement}
    if model is not None:
        spec["model"] = str(model)
    return spec


@pytest.fixture(scope="module")
def cases(tiny_model, hybrid_model, tmp_path_factory):
    """method -> (target checkpoint, drafter checkpoint or None, block size)."""
    dense = tiny_model("qwen3")
    heads = tmp_path_factory.mktemp("remote-heads")
    mtp_target = write_mtp_checkpoint(hybrid_model("qwen3_next"), heads / "next-mtp")
    return {
        "eagle3": (dense, write_eagle3_head(heads / "eagle3", dense, 200, [0, 1, 2]), 4),
        "dflash": (dense, write_dflash_head(heads / "dflash", dense), 4),
        "mtp": (mtp_target, None, 16),
    }


@pytest.fixture(scope="module")
def expected(cases):
    """expected(method) -> greedy tokens of its target without speculation (cached)."""
    cache: dict = {}

    def tokens_for(method: str) -> list[list[int]]:
        if method not in cache:
            target, _, block_size = cases[method]
            outs = run_to_completion(
                make_engine(target, block_size=block_size), PROMPTS, greedy(MAX_TOKENS)
            )
            cache[method] = [o.outputs[0].token_ids for o in outs]
        return cache[method]

    return tokens_for


def record_sync_steps(eng: Engine) -> list:
    """The SchedulerOutputs a synchronous engine runs, in order, for either executor."""
    seen = []
    execute = eng.executor.execute_model

    def recording(sched):
        seen.append(sched)
        return execute(sched)

    eng.executor.execute_model = recording
    return seen


def run_recorded(eng: Engine) -> tuple[list[list[int]], list[dict]]:
    """Greedy tokens per prompt, and the drafts each step verified."""
    steps = record_sync_steps(eng)
    outs = run_to_completion(eng, PROMPTS, greedy(MAX_TOKENS))
    return [o.outputs[0].token_ids for o in outs], [s.scheduled_spec_token_ids for s in steps]


@pytest.mark.parametrize("method", ["eagle3", "mtp", "dflash"])
def test_remote_hidden_state_drafter_drafts_as_in_process(local_ray, cases, expected, method):
    target, head, block_size = cases[method]
    expected = expected(method)
    local_tokens, local_drafts = run_recorded(
        make_engine(target, spec_of(method, head), block_size=block_size)
    )
    assert local_tokens == expected
    eng = make_engine(
        target, spec_of(method, head, "remote"), block_size=block_size, executor="ray"
    )
    try:
        assert eng.stats()["spec_drafter_available"] is True
        tokens, drafts = run_recorded(eng)
        assert tokens == expected
        assert eng.stats()["spec_drafted_tokens"] > 0
        # The same drafts at every step: the actor read the states the worker captured.
        assert drafts == local_drafts
    finally:
        eng.shutdown()


def drafter_pid(eng: Engine) -> int:
    import ray

    return ray.get(eng.executor.drafter.pid.remote())


def test_remote_eagle3_at_tp2_with_async_scheduling_is_lossless(local_ray, cases, expected):
    """TP rank 0 captures the auxiliary states and shares the drafts; a step scheduled
    ahead verifies placeholder drafts."""
    target, head, block_size = cases["eagle3"]
    eng = make_engine(
        target,
        spec_of("eagle3", head, "remote"),
        block_size=block_size,
        executor="ray",
        tensor_parallel_size=2,
        async_scheduling=True,
    )
    try:
        outs = run_to_completion(eng, PROMPTS, greedy(MAX_TOKENS))
        assert [o.outputs[0].token_ids for o in outs] == expected("eagle3")
        assert eng.stats()["spec_drafted_tokens"] > 0
    finally:
        eng.shutdown()


def test_a_killed_eagle3_drafter_leaves_requests_finishing(local_ray, cases, expected):
    target, head, block_size = cases["eagle3"]
    expected = expected("eagle3")
    eng = make_engine(
        target, spec_of("eagle3", head, "remote"), block_size=block_size, executor="ray"
    )
    steps = record_steps(eng)
    try:
        for i, prompt in enumerate(PROMPTS):
            eng.add_request(str(i), {"prompt_token_ids": prompt}, greedy(MAX_TOKENS))
        for _ in range(4):
            eng.step()
        assert any(s.scheduled_spec_token_ids for s in steps), "no drafts before the kill"
        killed_at = len(steps)
        os.kill(drafter_pid(eng), signal.SIGKILL)
        done = {}
        start = time.monotonic()
        while eng.has_unfinished_requests():
            assert time.monotonic() - start < 120, "requests did not finish after the kill"
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        assert [done[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
        after = steps[killed_at + 1 :]
        assert after and not after[0].scheduled_spec_token_ids, after[0]
        # Ray restarts the actor; the worker sets it up again (its hooks stay) and drafts.
        deadline = time.monotonic() + 60
        while not eng.stats().get("spec_drafter_available"):
            assert time.monotonic() < deadline, "the drafter actor did not come back"
            time.sleep(0.5)
        time.sleep(1.5)  # the worker retries its connection about once a second
        drafted = eng.stats()["spec_drafted_tokens"]
        again = run_to_completion(eng, PROMPTS, greedy(MAX_TOKENS))
        assert [o.outputs[0].token_ids for o in again] == expected
        assert eng.stats()["spec_drafted_tokens"] > drafted, "no drafts after the restart"
    finally:
        eng.shutdown()


def test_only_kept_rows_travel_and_the_actor_refills_them(cases):
    """A verification row with rejected drafts: the worker sends the kept tokens' states
    only; the service puts each back at its token's row (zeros at the rejected ones)."""
    import torch

    from kvloom.contracts.config import EngineConfig
    from kvloom.workers.spec_decode.drafter_messages import DRAFTER_PROTOCOL_VERSION, DraftSetup
    from kvloom.workers.spec_decode.drafter_server import DrafterService
    from kvloom.workers.spec_decode.remote_drafter import raw_tensor

    target, head, _ = cases["eagle3"]
    config = EngineConfig.from_kwargs(
        model=str(target), dtype="float64", speculative_config=spec_of("eagle3", head, k=2)
    )
    service = DrafterService(config, torch.device("cpu"))
    ready = service.setup(DraftSetup(DRAFTER_PROTOCOL_VERSION, 1, 16, 4, 2))
    assert ready.aux_points == service.drafter.format.aux_layer_ids
    assert ready.kept_rows_only and not ready.reads_hidden
    width = 3 * int(config.model.text_config["hidden_size"])
    # Row "a": a 3-token verification (2 drafts, the first accepted): 2 tokens kept.
    # Row "b": a 2-token prefill chunk that did not sample: both kept.
    kept = torch.arange(4 * width, dtype=torch.float64).view(4, width) + 1
    seen = {}

    def fake_run(step):
        seen["aux"] = service.aux.take()
        return {}

    service.drafter.run = fake_run
    from kvloom.workers.spec_decode.drafter_messages import DraftRequest

    msg = DraftRequest(
        version=DRAFTER_PROTOCOL_VERSION,
        step_id=1,
        request_ids=["a", "b"],
        input_ids=[7, 8, 9, 10, 11],
        positions=[5, 6, 7, 0, 1],
        query_start_loc=[0, 3, 5],
        num_computed_tokens=[5, 0],
        decode_only=False,
        block_ids={"a": [1, 2], "b": [3]},
        drafts={"a": [8, 9]},
        sampled={"a": [8, 12]},
        finished=[],
        num_tokens={"a": 6},
        hidden=None,
        next_tokens={"b": 13},
        aux_hidden=raw_tensor(kept),
        kept_rows_only=True,
    )
    service.draft(msg)
    full = torch.cat(seen["aux"], dim=-1)
    assert full.shape == (5, width)
    assert torch.equal(full[[0, 1, 3, 4]], kept)
    assert torch.equal(full[2], torch.zeros(width, dtype=torch.float64))
    # The wrong number of rows is refused, naming the field.
    bad = msg
    bad.aux_hidden = raw_tensor(kept[:3])
    with pytest.raises(ValueError, match="DraftRequest.aux_hidden"):
        service.draft(bad)


def test_the_worker_hooks_the_target_where_the_drafter_reads(cases):
    """DraftReady's capture points hook the worker's target; a step whose forward ran
    before the hooks were installed sends nothing (no states were captured for it)."""
    import torch

    from kvloom.contracts.config import EngineConfig, SpeculativeConfig
    from kvloom.workers.spec_decode.drafter_messages import DRAFTER_PROTOCOL_VERSION, DraftReady
    from kvloom.workers.spec_decode.remote_drafter import RemoteDrafter

    target_dir, head, _ = cases["eagle3"]
    model = full_target(EngineConfig.from_kwargs(model=str(target_dir), dtype="float64"))
    drafter = RemoteDrafter(
        SpeculativeConfig(method="eagle3", model=str(head), num_speculative_tokens=2),
        1.0,
        target=model,
    )
    ready = DraftReady(DRAFTER_PROTOCOL_VERSION, 1, False, [0, 2], True)

    def reconnect():
        drafter._adopt(ready)
        drafter.available = True
        return True

    drafter._reconnect = reconnect
    try:
        assert drafter._draft(step=None) == {}  # hooked now, after this step's forward
        assert drafter.capture.points == [0, 2] and drafter.kept_rows_only
        assert drafter._step_id == 0  # nothing was sent
        ids = torch.tensor([5, 6, 7])
        embeds = model.model.embed_tokens(ids)
        drafter.capture.states = {}
        model.model.embed_tokens(ids)  # the hook at point 0 fires
        assert torch.equal(drafter.capture.states[0], embeds)
        drafter._adopt(ready)  # a restarted drafter of the same head: the same hooks
        assert len(drafter.capture.handles) == 2
    finally:
        drafter.close()
    assert drafter.capture is None and not model.model.embed_tokens._forward_hooks


def full_target(config):
    """The whole target, loaded as a worker loads it (the worker side of these tests)."""
    from pathlib import Path

    from kvloom.workers.dtypes import TORCH_DTYPES
    from kvloom.workers.models.registry import model_class
    from kvloom.workers.weight_loader import iterate_checkpoint, load_weights

    klass = model_class(config.model.architecture)
    model = klass(config.model.text_config, TORCH_DTYPES[config.model.torch_dtype_name])
    checkpoint = iterate_checkpoint(Path(config.model.model), progress=False)
    load_weights(model, checkpoint, klass.stacked_params, klass.ignored_weight_prefixes, model.tied)
    return model.eval()


# -- the actor holds only the parts of the target its drafter reads ---------------------
DEEP_LAYERS = 4


@pytest.fixture(scope="module")
def deep(tiny_model, tmp_path_factory):
    """A tied-embedding Qwen3 target of several layers and an EAGLE-3 head reading the
    embedding, a middle layer and the last layer's output."""
    target = tiny_model("qwen3", num_hidden_layers=DEEP_LAYERS)
    head = write_eagle3_head(tmp_path_factory.mktemp("deep") / "eagle3", target, 200, [0, 2, 4])
    return target, head


def service_for(target, method, head, k=3):
    import torch

    from kvloom.contracts.config import EngineConfig
    from kvloom.workers.spec_decode.drafter_server import DrafterService

    config = EngineConfig.from_kwargs(
        model=str(target), dtype="float64", speculative_config=spec_of(method, head, k=k)
    )
    return config, DrafterService(config, torch.device("cpu"))


def assert_parts_only(names: dict[str, int], config: dict, tied: bool) -> None:
    """`names`: parameter name -> element count of the actor's target."""
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    want = {"model.embed_tokens.weight": vocab * hidden}
    if not tied:
        want["lm_head.weight"] = vocab * hidden
    assert names == want
    assert not [n for n in names if ".layers." in n or n.startswith("model.norm")]


def test_the_drafter_service_holds_only_the_embedding_and_lm_head(deep, cases):
    """No decoder layer (nor the final norm) of the target is loaded; a tied LM head is
    the embedding itself; an untied one (Qwen3-Next) is the checkpoint's; both, the config
    and MTP's layer kind are the whole target's."""
    import torch

    from kvloom.workers.models.qwen3_next import Qwen3NextDecoderLayer

    target_dir, head = deep
    config, service = service_for(target_dir, "eagle3", head)
    parts = service.drafter.target
    names = {n: p.numel() for n, p in parts.named_parameters()}
    assert_parts_only(names, config.model.text_config, tied=True)
    assert parts.lm_head.weight is parts.model.embed_tokens.weight
    assert len(parts.model.layers) == DEEP_LAYERS and not list(parts.model.layers.parameters())
    whole = full_target(config)
    hidden = torch.randn(3, config.model.text_config["hidden_size"], dtype=torch.float64)
    assert torch.equal(parts.compute_logits(hidden), whole.compute_logits(hidden))
    ids = torch.tensor([3, 1, 4])
    assert torch.equal(parts.model.embed_tokens(ids), whole.model.embed_tokens(ids))

    mtp_dir, _, _ = cases["mtp"]
    config, service = service_for(mtp_dir, "mtp", None, k=2)
    parts = service.drafter.target
    names = {n: p.numel() for n, p in parts.named_parameters()}
    assert_parts_only(names, config.model.text_config, tied=False)
    whole = full_target(config)
    assert torch.equal(parts.lm_head.weight, whole.lm_head.weight)
    assert torch.equal(parts.model.embed_tokens.weight, whole.model.embed_tokens.weight)
    assert parts.config == whole.config
    assert parts.decoder_layer_class is Qwen3NextDecoderLayer


def test_a_drafter_reading_what_the_actor_lacks_fails_at_start_naming_it(deep, monkeypatch):
    """A drafter that reads the target's final norm (not loaded in the actor) is refused
    when the service starts (its trial step), not at the target's first step."""
    from kvloom.workers.spec_decode.eagle3 import Eagle3Proposer

    def via_final_norm(self, hidden):
        return self.draft_targets[self.target.model.norm(hidden).argmax(dim=-1)]

    monkeypatch.setattr(Eagle3Proposer, "draft_ids", via_final_norm)
    target_dir, head = deep
    with pytest.raises(ValueError, match=r"target\.model\.norm: .*holds only"):
        service_for(target_dir, "eagle3", head)


def test_remote_eagle3_under_preemption_and_prefix_hits_drafts_as_in_process(local_ray, deep):
    """Shared prompt prefixes (hits: the head's KV in the actor is read from blocks it
    wrote for an earlier request) in a pool that preempts: greedy tokens equal no
    speculation and every step's drafts are the in-process head's. The actor holds the
    target's embedding and nothing else of it."""
    import ray

    from kvloom.contracts.config import EngineConfig

    target_dir, head = deep
    want = shared_prefix_tokens(make_engine(target_dir))
    # In process the head's KV is a second group of the target's pool: twice the pages
    # per request, so twice the usable pool schedules as the actor's placement does.
    local = make_engine(target_dir, spec_of("eagle3", head), num_kv_blocks=2 * TIGHT_POOL - 1)
    local_steps = record_sync_steps(local)
    assert shared_prefix_tokens(local) == want
    assert_preempted_and_hit(local.stats())
    eng = make_engine(
        target_dir, spec_of("eagle3", head, "remote"), executor="ray", num_kv_blocks=TIGHT_POOL
    )
    steps = record_sync_steps(eng)
    try:
        assert shared_prefix_tokens(eng) == want
        stats = eng.stats()
        assert_preempted_and_hit(stats)
        assert stats["spec_drafted_tokens"] > 0
        drafts = [s.scheduled_spec_token_ids for s in steps]
        assert drafts == [s.scheduled_spec_token_ids for s in local_steps]
        held = ray.get(eng.executor.drafter.target_parameters.remote())
        config = EngineConfig.from_kwargs(model=str(target_dir), dtype="float64")
        assert_parts_only(held, config.model.text_config, tied=True)
    finally:
        eng.shutdown()
