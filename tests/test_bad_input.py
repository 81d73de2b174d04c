"""Bad input raises ValueError naming the field or problem; the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvloom import LLM, Engine, SamplingParams
from tests.engine_helpers import assert_pool_full


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(model=str(tiny_model("llama")), progress=False, max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(seed=-1), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(logprobs=-1), "logprobs"),
        (dict(temperature=float("nan")), "temperature"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, problem",
    [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": list(range(5, 69))}, "max_model_len"),
        ({"prompt_token_ids": list(range(5, 100))}, "max_model_len"),
        ({"prompt_token_ids": [1, 2, 99999]}, "vocabulary"),
        ({"prompt_token_ids": [1, "x"]}, "prompt_token_ids"),
        ({"text": "hi"}, "prompt"),
        ({"prompt": "hi", "cache_salt": 5}, "cache_salt"),
    ],
)
def test_bad_prompts_rejected_engine_keeps_serving(engine, prompt, problem):
    with pytest.raises(ValueError, match=problem):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=2))
    engine.add_request("good", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert len(finished[0].outputs[0].token_ids) >= 1
    assert_pool_full(engine)


def test_duplicate_request_id_rejected(engine):
    engine.add_request("dup", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    engine.abort_request("dup")
    assert_pool_full(engine)


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="NoSuchModelForCausalLM"):
        LLM(str(path), progress=False)


def test_missing_weight_file(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(path), progress=False)


def test_missing_shard_named_in_index(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    save_file({k: tensors[k] for k in names[:half]}, path / "model-00001-of-00002.safetensors")
    (path / "model.safetensors").unlink()
    index = {
        "weight_map": {
            k: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, k in enumerate(names)
        }
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00002-of-00002"):
        LLM(str(path), progress=False)


def test_sharded_checkpoint_loads(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    for part, chunk in ((1, names[:half]), (2, names[half:])):
        save_file({k: tensors[k] for k in chunk}, path / f"model-0000{part}-of-00002.safetensors")
    (path / "model.safetensors").unlink()
    index = {
        "weight_map": {
            k: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, k in enumerate(names)
        }
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = LLM(str(path), progress=False).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0)
    )
    whole = LLM(str(tiny_model("llama")), progress=False).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0)
    )
    assert sharded[0].outputs[0].token_ids == whole[0].outputs[0].token_ids


def test_wrong_tensor_shape(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="k_proj.weight"):
        LLM(str(path), progress=False)


def test_missing_tensor(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj"):
        LLM(str(path), progress=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=-3), "max_num_batched_tokens"),
        (dict(num_kv_blocks=0), "num_kv_blocks"),
        (dict(dtype="int8"), "dtype"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(decode_context_parallel_size=0), "decode_context_parallel_size"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(max_model_len=1), "max_model_len"),
        # Past the model's max_position_embeddings (4096 for the tiny models): refused.
        (dict(max_model_len=8192), r"max_model_len .*max_position_embeddings"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
        (dict(no_such_option=1), "no_such_option"),
    ],
)
def test_bad_engine_config_names_the_field(tiny_model, kwargs, field):
    with pytest.raises(ValueError, match=field):
        Engine(model=str(tiny_model("llama")), progress=False, **kwargs)


def test_model_dir_must_exist(tmp_path):
    with pytest.raises(ValueError, match="model"):
        Engine(model=str(tmp_path / "nope"), progress=False)


def test_stop_token_text_is_not_in_the_output(tiny_model):
    """A request ended by a stop token id keeps the id in token_ids, not its text."""
    llm = LLM(str(tiny_model("llama")), progress=False)
    free = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0))[0]
    first = free.outputs[0].token_ids[0]
    tok = llm.get_tokenizer()
    stopped = llm.generate(
        [[5, 6, 7]],
        SamplingParams(
            max_tokens=8, temperature=0.0, stop_token_ids=[first], skip_special_tokens=False
        ),
    )[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == first
    assert stopped.text == "" and tok.decode([first], skip_special_tokens=False) != ""


def test_serve_refuses_max_model_len_past_the_model(tiny_model, capsys):
    """`kvloom serve --max-model-len 8192` on a 4096-position model exits 2 naming the flag."""
    from kvloom.cluster import cli

    assert cli.main(["serve", "--model", str(tiny_model("llama")), "--max-model-len", "8192"]) == 2
    err = capsys.readouterr().err
    assert "error: --max-model-len must be an integer in [2, 4096]" in err, err
    assert "max_position_embeddings" in err, err
