"""Structured outputs, offline: on a tiny random-weight model (its free output is noise, so
any structure comes from the grammar) JSON-schema, regex, choice, any-JSON and EBNF outputs
all conform, for random seeds, greedy and sampled, with async scheduling and preemption; a
grammar that does not compile fails its request only; requests without one get no mask."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvloom import LLM, Engine, SamplingParams, StructuredOutputsParams
from kvloom.cluster.engine_channel import RequestError
from kvloom.cluster.structured_outputs import RequestGrammar
from kvloom.cluster.structured_outputs.compiler import GrammarCompilers, choice_grammar
from kvloom.workers.sampler import RowSamplingState, apply_token_bitmasks, sample

ENGINE = dict(dtype="float32", block_size=4, max_model_len=256, num_kv_blocks=512)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
            "required": ["kind", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-\d{2}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "ab"'


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=model_dir, progress=False, **ENGINE)


def constrained(max_tokens: int = 96, seed: int | None = None, temperature=1.0, **kind):
    return SamplingParams(
        max_tokens=max_tokens,
        seed=seed,
        temperature=temperature,
        structured_outputs=StructuredOutputsParams(**kind),
    )


def texts(llm, params: list[SamplingParams], prompt: str = "hello") -> list[str]:
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), [
        (o.outputs[0].finish_reason, o.outputs[0].text) for o in outs
    ]
    return [o.outputs[0].text for o in outs]


# -- parameters -----------------------------------------------------------------------
def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="structured_outputs must be exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs must be exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs.json must be a JSON schema"):
        StructuredOutputsParams(json="[1, 2]")
    with pytest.raises(ValueError, match="structured_outputs.choice must be"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.regex must be"):
        StructuredOutputsParams(regex="")
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs.kind == "choice"
    assert StructuredOutputsParams(json={}).kind == "json"  # {} is a schema (any JSON)
    assert StructuredOutputsParams(json_object=True).spec == ""


def test_choice_grammar_escapes_like_json():
    assert choice_grammar(['a"b', "c\\d", "é\n"]) == r'root ::= "a\"b" | "c\\d" | "é\n"'


# -- the sampler's mask ---------------------------------------------------------------
def _bitmask(allowed: list[int], vocab: int) -> bytes:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor(words, dtype=torch.int64).to(torch.int32).numpy().tobytes()


def test_bitmask_application_matches_a_reference():
    vocab = 100
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen)
    allowed = [[0, 31, 32, 63, 64, 99], [], [5]]
    rows = [
        RowSamplingState(SamplingParams(), 0, [], [], token_bitmask=_bitmask(allowed[0], vocab)),
        RowSamplingState(SamplingParams(), 0, [], []),  # no grammar: untouched
        RowSamplingState(SamplingParams(), 0, [], [], token_bitmask=_bitmask(allowed[2], vocab)),
    ]
    masked = logits.clone()
    apply_token_bitmasks(masked, rows)
    for i in (0, 2):
        expect = torch.full((vocab,), float("-inf"))
        expect[allowed[i]] = logits[i, allowed[i]]
        torch.testing.assert_close(masked[i], expect, rtol=0, atol=0)
    torch.testing.assert_close(masked[1], logits[1], rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 5.0])
def test_sampling_picks_only_allowed_tokens(temperature):
    vocab, allowed = 512, [3, 77, 300, 511]
    gen = torch.Generator().manual_seed(1)
    for seed in range(20):
        logits = torch.randn(2, vocab, generator=gen) * 4
        params = SamplingParams(temperature=temperature)
        rows = [
            RowSamplingState(params, seed, [], [], token_bitmask=_bitmask(allowed, vocab)),
            RowSamplingState(params, seed, [], []),
        ]
        tokens, _ = sample(logits, rows, -1)
        assert tokens[0] in allowed
        if temperature == 0.0:
            assert tokens[1] == int(logits[1].argmax())


# -- offline generation ---------------------------------------------------------------
def test_json_schema_outputs_validate_for_random_seeds(llm):
    params = [constrained(seed=seed, json=SCHEMA) for seed in range(50)]
    outputs = texts(llm, params)
    for text in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(outputs)) > 10  # sampled: the grammar shapes, the seed still picks


def test_regex_choice_json_object_and_grammar_outputs_conform(llm):
    regex = texts(llm, [constrained(seed=s, regex=REGEX) for s in range(10)])
    assert all(re.fullmatch(REGEX, t) for t in regex), regex
    choice = texts(llm, [constrained(seed=s, choice=CHOICES) for s in range(10)])
    assert set(choice) <= set(CHOICES), choice
    greedy = texts(llm, [constrained(temperature=0.0, choice=CHOICES)] * 2)
    assert greedy[0] == greedy[1] and greedy[0] in CHOICES
    # Any JSON object: free strings let a noise model write on past any small max_tokens,
    # so only finished outputs must parse; every output is an object's prefix.
    objects = llm.generate(
        ["hello"] * 8, [constrained(seed=s, max_tokens=24, json_object=True) for s in range(8)]
    )
    for out in objects:
        text = out.outputs[0].text
        assert text.startswith("{"), text
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
    grammar = texts(llm, [constrained(seed=s, grammar=GRAMMAR) for s in range(10)])
    assert all(re.fullmatch(r"\((\d|ab)(,(\d|ab))*\)", t) for t in grammar), grammar


def test_bad_grammar_fails_only_its_request_and_returns_its_blocks(model_dir):
    engine = Engine(model=model_dir, progress=False, **ENGINE)
    try:
        free = engine.kv_cache.pool.num_free_blocks
        engine.add_request("bad", "hi", constrained(regex="(("))
        engine.add_request("good", "hi", constrained(seed=0, regex=REGEX))
        engine.add_request("free", "hi", SamplingParams(max_tokens=4))
        errors, finished = [], {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if isinstance(out, RequestError):
                    errors.append(out)
                elif out.finished:
                    finished[out.request_id] = out
        assert [e.request_id for e in errors] == ["bad"]
        assert errors[0].message.startswith("structured_outputs.regex: does not compile")
        assert re.fullmatch(REGEX, finished["good"].outputs[0].text)
        assert len(finished["free"].outputs[0].token_ids) == 4
        assert engine.kv_cache.pool.num_free_blocks == free
        assert engine.failure is None
    finally:
        engine.shutdown()


def test_offline_generate_raises_for_a_bad_schema(llm):
    with pytest.raises(ValueError, match="structured_outputs.json: does not compile"):
        llm.generate("hi", constrained(json={"type": "nonsense"}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_grammars_are_compiled_once_per_spec(model_dir):
    compilers = GrammarCompilers(model_dir, 512, [2])
    try:
        a = compilers.submit(StructuredOutputsParams(regex="ab+"))
        b = compilers.submit(StructuredOutputsParams(regex="ab+"))
        c = compilers.submit(StructuredOutputsParams(choice=["ab+"]))
        assert a is b and a is not c
        assert a.result(timeout=60) is b.result()
    finally:
        compilers.shutdown()


def _run(engine: Engine, params: dict[str, SamplingParams], record=None) -> dict[str, str]:
    for rid, p in params.items():
        engine.add_request(rid, "hello there", p)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not isinstance(out, RequestError), out
            if out.finished:
                outs[out.request_id] = out.outputs[0]
    return outs


def test_unconstrained_requests_get_no_mask_and_the_same_tokens(model_dir):
    engine = Engine(model=model_dir, progress=False, **ENGINE)
    masked_ids: set[str] = set()
    executor = engine.executor

    def recording(method):  # execute_model, and submit (async scheduling: CUDA's default)
        def run(sched):
            masked_ids.update(sched.grammar_bitmasks)
            return method(sched)

        return run

    executor.execute_model = recording(executor.execute_model)
    if hasattr(executor, "submit"):
        executor.submit = recording(executor.submit)
    try:
        free = SamplingParams(max_tokens=12, seed=3)
        mixed = _run(engine, {"free": free, "json": constrained(seed=1, json=SCHEMA)})
        alone = _run(engine, {"free2": free})
    finally:
        engine.shutdown()
    assert masked_ids == {"json"}
    assert mixed["free"].token_ids == alone["free2"].token_ids
    jsonschema.validate(json.loads(mixed["json"].text), SCHEMA)


@pytest.mark.parametrize(
    "setting",
    [dict(async_scheduling=True), dict(num_kv_blocks=48, enable_prefix_caching=True)],
    ids=["async", "preemption"],
)
def test_outputs_do_not_depend_on_async_scheduling_or_preemption(model_dir, setting):
    params = {
        f"{kind}{seed}": constrained(seed=seed, **{kind: spec})
        for seed in range(4)
        for kind, spec in (("json", SCHEMA), ("regex", REGEX), ("choice", CHOICES))
    }
    params["free"] = SamplingParams(max_tokens=40, seed=9)
    base = Engine(model=model_dir, progress=False, **ENGINE)
    try:
        expect = _run(base, params)
    finally:
        base.shutdown()
    engine = Engine(model=model_dir, progress=False, **{**ENGINE, **setting})
    try:
        got = _run(engine, params)
        if "num_kv_blocks" in setting:
            assert engine.stats()["num_preemptions"] > 0
        else:
            assert engine.async_scheduling
    finally:
        engine.shutdown()
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in expect.items()}
    for rid, out in got.items():
        assert out.finish_reason == ("length" if rid == "free" else "stop")
        if rid.startswith("json"):
            jsonschema.validate(json.loads(out.text), SCHEMA)
        elif rid.startswith("regex"):
            assert re.fullmatch(REGEX, out.text)
        elif rid.startswith("choice"):
            assert out.text in CHOICES


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_gives_the_tokens_of_no_speculation_and_stays_in_the_grammar(
    model_dir, method, monkeypatch
):
    """Drafts are cut where the grammar forbids them (the scheduler checks them against the
    matcher and rolls it back), every verified lane is masked, and only emitted tokens
    advance the matcher: greedy tokens equal those without speculation."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["draft_model"] = model_dir  # itself: its drafts are the free greedy tokens
    greedy = {
        f"{kind}": constrained(temperature=0.0, **{kind: value})
        for kind, value in (("json", SCHEMA), ("regex", REGEX), ("choice", CHOICES))
    }
    sampled = {f"json{s}": constrained(seed=s, json=SCHEMA) for s in range(4)}
    base = Engine(model=model_dir, progress=False, **ENGINE)
    try:
        expect = _run(base, greedy)
    finally:
        base.shutdown()
    checked: list[tuple[int, int]] = []  # (drafts proposed, drafts the grammar allows)
    valid_prefix = RequestGrammar.valid_draft_prefix

    def recording(self, drafts):
        checked.append((len(drafts), valid_prefix(self, drafts)))
        return checked[-1][1]

    monkeypatch.setattr(RequestGrammar, "valid_draft_prefix", recording)
    engine = Engine(model=model_dir, progress=False, speculative_config=spec, **ENGINE)
    try:
        got = _run(engine, {**greedy, **sampled})
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert sum(n for n, _ in checked) > 0
    if method == "ngram":  # its drafts come from the constrained output: some are valid
        assert stats["spec_drafted_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    # The drafter's free greedy tokens mostly leave the grammar: those are cut.
    assert any(valid < n for n, valid in checked)
    assert {k: got[k].token_ids for k in greedy} == {k: v.token_ids for k, v in expect.items()}
    for rid, out in got.items():
        assert out.finish_reason == "stop", (rid, out.text)
        if rid.startswith("json"):
            jsonschema.validate(json.loads(out.text), SCHEMA)
    assert re.fullmatch(REGEX, got["regex"].text) and got["choice"].text in CHOICES


def test_masks_and_constraints_survive_the_step_channel_codec():
    """The Ray executor sends SchedulerOutput as msgpack (contracts/step_channel.py), and a
    remote engine's requests carry their SamplingParams the same way."""
    import msgspec

    from kvloom.contracts.scheduler_output import SchedulerOutput

    out = SchedulerOutput(grammar_bitmasks={"r": _bitmask([1, 40], 64)})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput)
    assert back.grammar_bitmasks == out.grammar_bitmasks
    for kind in (dict(json=SCHEMA), dict(choice=CHOICES), dict(json_object=True)):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(**kind))
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
        assert decoded == params
