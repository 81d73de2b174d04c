"""Multi-turn prefix-cache hit rate, TTFT and request throughput by routing policy and
number of data-parallel replicas (cluster/replicas.py, cluster/routing.py), on local Ray.

Conversations of several turns; each turn's prompt is the previous prompt + its output +
new user tokens, and each turn's requests arrive in a new order (as real clients' do).

    python benchmarks/replica_routing.py --model DIR --replicas 1 2 4 \
        --policies prefix least-loaded round-robin --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

from kvloom import SamplingParams
from kvloom.cluster.engine_channel import RequestError
from kvloom.cluster.replicas import ReplicaSet


def run_turn(engine, prompts: list[list[int]], params: SamplingParams) -> list:
    ids = []
    for prompt in prompts:
        rid = engine.next_request_id()
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        ids.append(rid)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if isinstance(out, RequestError):
                raise RuntimeError(out.message)
            if out.finished:
                done[out.request_id] = out
    return [done[rid] for rid in ids]


def conversations(engine, args) -> dict:
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    prompts = [
        [5 + rng.randrange(400) for _ in range(rng.randint(args.first_min, args.first_max))]
        for _ in range(args.conversations)
    ]
    cached = queried = 0
    ttfts: list[float] = []
    start = time.perf_counter()
    for turn in range(args.turns):
        order = list(range(len(prompts)))
        rng.shuffle(order)
        outs = dict(zip(order, run_turn(engine, [prompts[i] for i in order], params)))
        if turn:
            cached += sum(o.num_cached_tokens for o in outs.values())
            queried += sum(len(o.prompt_token_ids) for o in outs.values())
            ttfts += [o.metrics["ttft_s"] for o in outs.values()]
        prompts = [
            p + outs[i].outputs[0].token_ids + [5 + rng.randrange(400) for _ in range(16)]
            for i, p in enumerate(prompts)
        ]
    seconds = time.perf_counter() - start
    ttfts.sort()
    return {
        "hit_rate_turns_2_on": cached / max(queried, 1),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "seconds": seconds,
        "requests_per_s": args.conversations * args.turns / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--policies", nargs="+", default=["prefix", "least-loaded", "round-robin"])
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-min", type=int, default=200)
    parser.add_argument("--first-max", type=int, default=400)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    settings = dict(model=args.model, dtype="float32", executor="ray", progress=False)
    results = []
    for n in args.replicas:
        for policy in args.policies if n > 1 else ["prefix"]:
            engine = ReplicaSet(settings, n, routing=policy)
            try:
                row = {"replicas": n, "routing": policy, **conversations(engine, args)}
            finally:
                engine.shutdown()
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
