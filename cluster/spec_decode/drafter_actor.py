"""Starts the drafter of `speculative_config.placement = "remote"` as a Ray actor.

The actor (workers/spec_decode/drafter_server.py) loads the drafter on a device of its own
when the cluster has a GPU beyond the target's grid, else on the CPU (a GPU target then
drafts slowly: the log says so). It is outside the target's placement group, so it never
takes a bundle the grid needs, and Ray restarts it when its process dies; the target's
workers keep serving without speculation meanwhile and reconnect when it is back
(workers/spec_decode/remote_drafter.py).
"""

from __future__ import annotations

import logging

from kvloom.contracts.config import EngineConfig

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # loading a large drafter's weights
PING_TIMEOUT_S = 0.5


# Methods whose drafter runs remotely: what each reads of the target travels in
# drafter_messages.py (final or auxiliary hidden states; MTP's layer and the target's
# embedding and LM head are loaded by the actor from the target's checkpoint).
REMOTE_METHODS = ("draft_model", "eagle", "eagle3", "mtp", "dflash")


def check_remote_placement(config: EngineConfig) -> None:
    """Settings a remote drafter cannot serve, refused before anything starts."""
    spec = config.speculative
    if spec.method == "ngram":
        raise ValueError(
            "speculative_config.placement 'remote' runs a drafter model; method 'ngram' has "
            "none (use placement 'local')"
        )
    if spec.method not in REMOTE_METHODS:
        raise ValueError(
            f"speculative_config.placement 'remote' supports methods {REMOTE_METHODS} for "
            f"now, got {spec.method!r} (use placement 'local')"
        )


def start_drafter_actor(config: EngineConfig, target_uses_gpu: bool):
    """The drafter actor's handle, once it has loaded (a bad drafter raises ValueError)."""
    import ray

    from kvloom.cluster.ray_local import actor_runtime_env, first_line
    from kvloom.workers.spec_decode.drafter_server import DrafterActor

    check_remote_placement(config)
    spare_gpus = ray.available_resources().get("GPU", 0)
    use_gpu = target_uses_gpu and spare_gpus >= 1
    if target_uses_gpu and not use_gpu:
        logger.warning("no GPU is free for the remote drafter: it runs on the CPU")
    actor = (
        ray.remote(DrafterActor)
        .options(
            num_cpus=0 if use_gpu else 1,
            num_gpus=1 if use_gpu else 0,
            max_restarts=-1,
            runtime_env=actor_runtime_env(),
        )
        .remote(config, use_gpu)
    )
    try:
        ray.get(actor.ready.remote(), timeout=READY_TIMEOUT_S)
    except ray.exceptions.RayTaskError as err:
        ray.kill(actor)
        if isinstance(err.cause, ValueError):
            raise ValueError(str(err.cause)) from None
        raise RuntimeError(f"the remote drafter failed to load: {first_line(err)}") from err
    except Exception:
        ray.kill(actor)
        raise
    return actor


def drafter_answers(actor) -> bool:
    """Whether the drafter actor answers now (False while it is dead or restarting)."""
    import ray

    try:
        return bool(ray.get(actor.ready.remote(), timeout=PING_TIMEOUT_S))
    except Exception:
        return False
