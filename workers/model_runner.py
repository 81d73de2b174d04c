"""Runs one scheduled step on a worker: batch tensors, forward, logits, sampling."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from kvloom.contracts import envs
from kvloom.contracts.config import EngineConfig
from kvloom.contracts.kv_cache_plan import (
    REPORTED_BLOCK_SIZE,
    KVCacheMemory,
    KVCachePlan,
    KVCacheSpecs,
    PageLayout,
)
from kvloom.contracts.kv_cache_spec import KVCacheGroup, LinearStateSpec
from kvloom.contracts.runner_output import ModelRunnerOutput
from kvloom.contracts.scheduler_output import (
    PLACEHOLDER_TOKEN_ID,
    GrammarBitmasks,
    SchedulerOutput,
)
from kvloom.kernels.device_copy import to_device, to_device_packed
from kvloom.kernels.dispatch import set_batch_invariant
from kvloom.kernels.ops import greedy_argmax
from kvloom.workers.attention_metadata import ForwardBatch, GroupMetadata
from kvloom.workers.awaiting_masks import AwaitingMasksStep
from kvloom.workers.batch_arrays import slot_mapping, token_positions
from kvloom.workers.cache_pages import allocate_pages
from kvloom.workers.cuda_graphs import TargetGraphs, capture_sizes, graph_key_for
from kvloom.workers.distributed.graph_collectives import warm_up_for_capture
from kvloom.workers.dtypes import TORCH_DTYPES
from kvloom.workers.graph_capture import CudaStepGraph
from kvloom.workers.input_batch import InputBatch
from kvloom.workers.kv_cache_scales import KVCacheScales, has_kv_cache_scheme
from kvloom.workers.layers.attention import PagedAttention
from kvloom.workers.layers.quantization.build import build_model, checkpoint_weights
from kvloom.workers.layers.tp_group import LocalGroup, TPGroup
from kvloom.workers.memory_profile import (
    graph_margin,
    profile_memory,
    report_graph_memory,
)
from kvloom.workers.models.registry import model_class
from kvloom.workers.pending_step import PendingStep
from kvloom.workers.row_kinds import RowClasses, classify_rows
from kvloom.workers.sampler import (
    RowSamplingState,
    apply_lane_bitmasks,
    logprob_infos,
    sample,
    sample_on_device,
)
from kvloom.workers.spec_decode.carry import SpecCarry
from kvloom.workers.spec_decode.draft_model import DRAFT_LAYER_OFFSET, DraftModel
from kvloom.workers.spec_decode.drafter import DraftStep
from kvloom.workers.spec_decode.eagle import EagleProposer
from kvloom.workers.spec_decode.factory import build_drafter, check_drafter
from kvloom.workers.spec_decode.ngram_proposer import NgramProposer
from kvloom.workers.spec_decode.rejection_sampler import rejection_sample
from kvloom.workers.weight_loader import iterate_checkpoint, load_weights

DEFAULT_CPU_KV_BYTES = 64 * 2**20


# Quantized layers' scales under dummy weights, so dequantized weights come out near the
# float N(0, 0.02): FP8 codes are drawn N(0, 1); int4 codes uniform over -8..7 (std ~4.6).
DUMMY_SCALES = {"weight_scale_inv": 0.02, "weight_scale": 0.02, "input_scale": 1.0}
DUMMY_INT4_SCALE = 0.005


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights for benchmarking real shapes: matrices N(0, 0.02), norms 1,
    other vectors 0. Drawn on the parameters' device (fast for multi-GB models).
    Quantized layers get random codes and fixed scales (DUMMY_SCALES)."""
    generators: dict = {}
    params = dict(model.named_parameters())
    for name, param in params.items():
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        owner, _, leaf = name.rpartition(".")
        if leaf in DUMMY_SCALES:
            int4 = f"{owner}.weight_packed" in params
            param.fill_(DUMMY_INT4_SCALE if int4 and leaf == "weight_scale" else DUMMY_SCALES[leaf])
        elif param.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            codes = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            param.copy_(codes.normal_(0.0, 1.0, generator=gen).to(param.dtype))
        elif param.dtype == torch.int32:  # packed int4 codes: every bit pattern is valid
            param.random_(generator=gen)
        elif not param.is_floating_point():
            continue  # shapes and other integer metadata stay as built
        elif param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.zero_()


logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, device: torch.device, tp: TPGroup | None = None, dcp=None
    ):
        self.config = config
        self.device = device
        self.tp = tp or LocalGroup()
        # Decode context parallelism: attention KV is sharded over the DCP group by token.
        self.dcp = dcp if dcp is not None and dcp.world_size > 1 else None
        self.dcp_size = 1 if self.dcp is None else self.dcp.world_size
        self.dcp_rank = 0 if self.dcp is None else self.dcp.rank_in_group
        self.dtype_name = config.model.torch_dtype_name
        self.dtype = TORCH_DTYPES[self.dtype_name]
        self.input_batch = InputBatch()
        self.model = None
        # From the control plane's KV-cache plan (apply_kv_cache_plan): tokens per block on
        # this rank, the groups, layer key -> group, where each layer's pages live.
        self.block_size: int | None = None
        self.groups: list[KVCacheGroup] = []
        self.layer_to_group: dict[int, int] = {}
        self.layout: PageLayout | None = None
        self.draft: DraftModel | EagleProposer | None = None
        self.ngram: NgramProposer | None = None
        # Speculative decoding: every step verifies and proposes on the host side of the
        # worker, and leaves its outcome for the step behind it (workers/spec_decode/carry.py).
        self.speculative = config.speculative.enabled
        self.spec_carry = SpecCarry()
        # This step's rows (speculative path): the tokens the worker knows of each sampled
        # request, the drafts it verifies (placeholders filled) and the slots scheduled.
        self.step_history: dict[str, list[int]] = {}
        self.step_drafts: dict[str, list[int]] = {}
        self.step_draft_slots: dict[str, int] = {}
        self.step_sample_positions: dict[str, int] = {}
        # CUDA graphs: one-token decodes, and (k + 1)-token verifications with speculation
        # (workers/cuda_graphs.py); this step's drafts per row decide between them.
        self.graphs: TargetGraphs | None = None
        self.verify_graphs: TargetGraphs | None = None
        self.step_row_drafts: list[int] = []
        # A state run past the pool's blocks that verification graphs' padding rows use.
        self.scratch_state: int | None = None
        self.page_buffers: list[torch.Tensor] = []  # the KV-cache pages, by block id
        # The last submitted step's sampled ids (device), their row per request, and the
        # token position each lands at: a step scheduled ahead reads its inputs from them.
        self.prev_sampled: torch.Tensor | None = None
        self.prev_rows: dict[str, int] = {}
        self.prev_positions: dict[str, int] = {}
        self.step_pending: dict[str, int] = {}  # this step's rows: tokens read from device
        self.step_bitmasks: dict[str, bytes] = {}  # this step's structured-output masks
        # Async scheduling: the launched step whose sampling waits for its grammar masks.
        self.awaiting_masks: AwaitingMasksStep | None = None

    def load_model(self, progress: bool = True) -> None:
        check_drafter(self.config.speculative, self.config.model)  # before the target loads
        klass = model_class(self.config.model.architecture)
        # Float, or quantized as the checkpoint's quantization_config says.
        model = build_model(klass, self.config.model, self.dtype, self.tp, self.device)
        scales = KVCacheScales(
            has_kv_cache_scheme(self.config.model.hf_config), klass.ignored_weight_prefixes
        )
        if self.config.model.load_format == "dummy":
            fill_dummy_weights(model, self.config.model.seed)
        else:
            load_weights(
                model,
                scales.take(
                    checkpoint_weights(
                        self.config.model,
                        iterate_checkpoint(Path(self.config.model.model), progress=progress),
                    )
                ),
                klass.stacked_params,
                klass.ignored_weight_prefixes,
                model.tied,
            )
        scales.apply(model.cache_layers(), self.config.cache.kv_cache_dtype)
        self.model = model.eval()
        spec_cfg = self.config.speculative
        if spec_cfg.method == "ngram":
            self.ngram = NgramProposer(spec_cfg.prompt_lookup_min, spec_cfg.prompt_lookup_max)
        elif spec_cfg.method is not None:
            if self.dcp is not None:
                raise ValueError(
                    f"speculative_config.method {spec_cfg.method!r} does not support "
                    "decode_context_parallel_size > 1 yet"
                )
            self.draft = build_drafter(
                spec_cfg,
                model,
                self.dtype,
                self.tp,
                self.device,
                int(self.config.model.text_config["vocab_size"]),
                progress,
                target_config=self.config.model,
            )
        if self.dcp is not None:
            self._attach_dcp(model, model.kv_cache_specs(REPORTED_BLOCK_SIZE, self.dtype_name))

    def kv_cache_specs(self) -> KVCacheSpecs:
        """What this rank's cache-owning layers keep, for the control plane to plan from
        (cluster/kv_cache/planner.py): the layers' own specs, at REPORTED_BLOCK_SIZE."""
        target = self.model.kv_cache_specs(REPORTED_BLOCK_SIZE, self.dtype_name)
        draft = {}
        if self.draft is not None:
            draft = self.draft.kv_cache_specs(REPORTED_BLOCK_SIZE, self.dtype_name)
        return KVCacheSpecs(target, draft)

    def apply_kv_cache_plan(self, plan: KVCachePlan) -> None:
        """Takes the control plane's plan: groups (one block table each per request), the
        block size, and where every layer's pages live."""
        layer_to_group = plan.layer_to_group
        keys = {key for _, key in self.cache_layers()}
        if keys != layer_to_group.keys():
            raise ValueError(
                "the KV-cache plan does not cover this worker's layers: "
                f"missing {sorted(keys - layer_to_group.keys())}, "
                f"unknown {sorted(layer_to_group.keys() - keys)}"
            )
        self.block_size = plan.block_size // self.dcp_size
        self.groups = plan.groups
        self.layout = plan.layout
        self.layer_to_group = layer_to_group
        if self.draft is not None:
            self.draft.bind_groups(self.layer_to_group)

    def cache_layers(self) -> list[tuple[object, int]]:
        """(layer, its key in layer_to_group) for every cache-owning layer, draft included."""
        out = [(layer, layer.layer_index) for layer in self.model.cache_layers()]
        if self.draft is not None:
            out += [
                (layer, DRAFT_LAYER_OFFSET + layer.layer_index)
                for layer in self.draft.model.cache_layers()
            ]
        return out

    def _attach_dcp(self, model, specs: dict) -> None:
        """Full/sliding attention layers shard their KV over the DCP group; linear-state
        layers keep their state replicated on every DCP rank."""
        for layer in model.cache_layers():
            spec = specs[layer.layer_index]
            if isinstance(spec, LinearStateSpec):
                continue
            if not isinstance(layer, PagedAttention):
                raise ValueError(
                    "decode_context_parallel_size > 1 is not supported for "
                    f"{type(layer).__name__} layers ({type(spec).__name__})"
                )
            layer.dcp = self.dcp

    # -- KV cache -------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        """Bytes one pool block costs on this rank (the plan's layout: a page in every
        shared buffer, plus the drafter's private pages)."""
        return self.layout.bytes_per_block

    def available_kv_memory(self) -> KVCacheMemory:
        """The bytes this rank can give the KV cache under the plan it was given:
        `kv_cache_memory_bytes` when set, else on CUDA what a profiling run of the largest
        step leaves (workers/memory_profile.py), else the CPU default."""
        budget = self.config.cache.kv_cache_memory_bytes
        if budget is not None:
            return KVCacheMemory(budget, f"kv_cache_memory_bytes {budget}")
        if self.device.type == "cuda":
            profile = profile_memory(self, self._graph_margin())
            return KVCacheMemory(profile.kv_budget, profile.describe())
        return KVCacheMemory(DEFAULT_CPU_KV_BYTES, "the CPU default of 64 MiB")

    def initialize_kv_cache(self, num_blocks: int, capture_graphs: bool = True) -> None:
        """Every cache-owning layer allocates its pages (KV blocks or state slots), indexed
        by block ids of the one shared pool; then decode CUDA graphs are captured."""
        # A recurrent state spans `pages_per_state` pages from its block id on: slack pages
        # after the last block let the last block ids hold one too.
        span = max(
            (g.spec.pages_per_state for g in self.groups if isinstance(g.spec, LinearStateSpec)),
            default=1,
        )
        # Speculation on a hybrid: one more state run, the scratch state that padding rows
        # of verification graphs read and write (workers/cuda_graphs.py).
        linear = any(isinstance(g.spec, LinearStateSpec) for g in self.groups)
        scratch = span if self.speculative and linear else 0
        self.scratch_state = num_blocks + span - 1 if scratch else None
        shared = [
            allocate_pages(num_blocks + span - 1 + scratch, self.layout.page_bytes, self.device)
            for _ in range(self.layout.num_buffers)
        ]
        # Every page buffer by block id (raw page copies and the sanitizer's fills).
        self.page_buffers = [pages[:num_blocks] for pages in shared]
        for layer, key in self.cache_layers():
            spec = self.groups[self.layer_to_group[key]].spec
            if key in self.layout.buffer_of:
                pages = shared[self.layout.buffer_of[key]]
                if not isinstance(spec, LinearStateSpec):
                    pages = pages[:num_blocks]
            else:  # a drafter layer
                pages = allocate_pages(num_blocks, self.layout.private_page_bytes[key], self.device)
                self.page_buffers.append(pages)
            layer.allocate_cache(pages, spec)
        # A drafter in its own actor (remote_drafter.py) sizes its pages to this pool.
        kv_cache_ready = getattr(self.draft, "kv_cache_ready", None)
        if kv_cache_ready is not None:
            kv_cache_ready(num_blocks, self.groups)
        sizes = self._graph_sizes()
        if capture_graphs and sizes:
            before = torch.cuda.memory_reserved(self.device)
            self.capture_graphs(CudaStepGraph, sizes)
            report_graph_memory(
                torch.cuda.memory_reserved(self.device) - before, self._graph_margin()
            )

    def _graph_margin(self) -> int:
        return graph_margin(bool(self._graph_sizes()), self.speculative)

    def capture_graphs(self, make_graph, sizes: list[int]) -> None:
        """Captures the target's decode graphs, its (rows, k) verification graphs with
        speculation, and the drafter's proposal graphs where it has them, all in one
        memory pool. make_graph: CudaStepGraph, or EagerStepGraph in CPU tests."""
        set_batch_invariant(self.config.model.deterministic)  # graphs capture this mode's plans
        max_len = self.config.scheduler.max_model_len
        # A replay runs no Python: states that drafters hook out of the target's forward
        # become graph outputs (EAGLE-3, DFlash: AuxHiddenCapture).
        aux = getattr(self.draft, "capture", None)
        warm_up_for_capture(self.tp, self.dcp)
        self.graphs = TargetGraphs(
            self.model, self.groups, self.layer_to_group, self.device, sizes, max_len, aux=aux
        )
        self.graphs.capture(make_graph)
        pool = self.graphs.pool
        k = self.config.speculative.num_speculative_tokens if self.speculative else 0
        verify_blockers = self.verify_graph_blockers()
        for reason in verify_blockers:
            logger.info("verification steps run eagerly: %s", reason)
        if k and not verify_blockers:
            self.verify_graphs = TargetGraphs(
                self.model,
                self.groups,
                self.layer_to_group,
                self.device,
                sizes,
                max_len,
                query_len=k + 1,
                pad_state=self._verify_pad_state(),
                prepare=self._zero_scratch_state,
                aux=aux,
            )
            self.verify_graphs.capture(make_graph, pool)
            pool = self.verify_graphs.pool
        reasons = self.drafter_graph_blockers()
        if self.draft is not None and not reasons:
            self.draft.capture_graphs(make_graph, sizes, self.groups, max_len, pool)
            catch_up = getattr(self.draft, "capture_catch_up_graphs", None)
            if catch_up is not None and k:
                try:
                    catch_up(make_graph, sizes, self.groups, max_len, k, self.draft.graphs.pool)
                except RuntimeError as err:  # not yet run on every GPU: stay eager, loudly
                    self.draft.catch_up_graphs = None
                    logger.warning("drafter catch-up runs eagerly: its capture failed: %s", err)
        for reason in reasons:
            logger.info("drafter forwards run eagerly: %s", reason)

    def _zero_scratch_state(self) -> None:
        """Inside a verification graph, before the forward: the scratch state its padding
        rows use starts from zeros at every replay (nothing stale, nothing growing)."""
        if self.scratch_state is None:
            return
        for layer in self.model.cache_layers():
            spec = self.groups[self.layer_to_group[layer.layer_index]].spec
            if isinstance(spec, LinearStateSpec):
                layer.conv_state[self.scratch_state].zero_()
                layer.recurrent_state[self.scratch_state].zero_()

    def release_kv_cache(self) -> None:
        self.graphs = None
        self.verify_graphs = None
        release = getattr(self.draft, "release_graphs", None)
        if release is not None:
            release()
        self.page_buffers = []
        for layer, _ in self.cache_layers():
            layer.release_cache()

    def _graph_sizes(self) -> list[int]:
        """The CUDA-graph ladder, empty where graphs are off or not yet safe (see
        `graph_blockers` and workers/cuda_graphs.py)."""
        if self.graph_blockers():
            return []
        most = min(self.config.model.max_cuda_graph_batch_size, self.config.scheduler.max_num_seqs)
        return capture_sizes(most)

    def graph_blockers(self) -> list[str]:
        """Why the target's CUDA graphs stay off on this rank (empty: they are captured).

        - TP > 1: the row-parallel all-reduce (and the vocab-parallel all-gather) are
          torch.distributed NCCL calls, captured into the graph once the communicators
          are warmed up (graph_collectives.py); opt-in through
          KVLOOM_MULTI_RANK_CUDA_GRAPHS until a multi-GPU run verifies it. Every rank makes
          the same replay decision (same step, same row classification, same drafts).
        - DCP > 1: the attention shards' all-gather has sizes fixed by the captured shape
          (every DCP rank holds all the step's queries; only the KV is sharded), so it is
          capturable behind the same switch; a shard's attention is the Triton paged
          kernel with kv_stride / kv_offset (lengths stay on the device), as capturable
          as the whole-cache one.
        - A drafter in its own actor (placement "remote"): it hooks the target's layers
          for auxiliary states only once the actor says what it reads, after capture,
          and a replay runs no hooks.
        A local drafter no longer blocks them: verification steps replay (rows, k) graphs
        and the drafter's proposal positions their own (`drafter_graph_blockers`).
        """
        blockers = []
        if self.config.model.enforce_eager:
            blockers.append("enforce_eager")
        if self.device.type != "cuda":
            blockers.append("not a CUDA device")
        multi_rank = envs.multi_rank_cuda_graphs()
        if self.tp.world_size > 1 and not multi_rank:
            blockers.append(
                "tensor_parallel_size > 1 (collectives are not verified graph-safe yet; "
                "KVLOOM_MULTI_RANK_CUDA_GRAPHS=1 captures the NCCL all-reduce)"
            )
        if self.dcp is not None and not multi_rank:
            blockers.append(
                "decode_context_parallel_size > 1 (collectives are not verified "
                "graph-safe yet; KVLOOM_MULTI_RANK_CUDA_GRAPHS=1 captures the all-gather)"
            )
        if getattr(self.config.speculative, "placement", None) == "remote":
            blockers.append(
                "a remote drafter (it hooks the target's layers after capture; a replay "
                "runs no hooks)"
            )
        if not getattr(self.model, "supports_cuda_graphs", False):
            blockers.append(f"{type(self.model).__name__} does not declare supports_cuda_graphs")
        return blockers

    def _linear_layers(self) -> list:
        """The target's layers whose KV-cache group is linear state."""
        return [
            layer
            for layer in self.model.cache_layers()
            if isinstance(self.groups[self.layer_to_group[layer.layer_index]].spec, LinearStateSpec)
        ]

    def _verify_pad_state(self) -> int:
        """The state index of a verification graph's padding rows: -1 (skipped) where every
        linear layer serves the rows token by token, else the scratch state the varlen
        kernels read and write (they take every row)."""
        serial = all(getattr(x, "captures_uniform_resume", False) for x in self._linear_layers())
        return -1 if self.scratch_state is None or serial else self.scratch_state

    def verify_graph_blockers(self) -> list[str]:
        """Why (rows, k) verification steps run eagerly while decode steps replay graphs.
        A hybrid target's (k + 1)-token rows need linear-attention layers that serve them
        without host-side sequence bounds (`captures_uniform_resume`: Gated DeltaNet and
        KDA run them token by token; the varlen conv and chunked kernels they replace
        failed to capture on the H200; the token-by-token path passed the H200's
        verification-graph tests for Qwen3-Next and Kimi-Linear)."""
        linear = self._linear_layers()
        if not (self.speculative and linear and self.device.type == "cuda"):
            return []
        lacking = sorted(
            {type(x).__name__ for x in linear if not getattr(x, "captures_uniform_resume", False)}
        )
        if lacking:
            return [
                f"{', '.join(lacking)} layers serve (k + 1)-token rows with the varlen conv / "
                "chunked kernels, which read sequence bounds on the host"
            ]
        return []

    def drafter_graph_blockers(self) -> list[str]:
        """Why the drafter's own forwards run eagerly while the target's replay graphs
        (logged at capture; empty without a drafter or when they are captured)."""
        if self.draft is None:
            return []
        if getattr(self.draft, "capture_graphs", None) is None:
            method = self.config.speculative.method
            if self.config.speculative.placement == "remote":
                return [f"{method}: the drafter runs in its own actor"]
            if method == "dflash":
                return [
                    "dflash: one block forward per step whose attention spans the batch's "
                    "longest context, a host-side size a graph cannot vary"
                ]
            return [f"{type(self.draft).__name__} has no proposal graphs"]
        return []

    def poison_blocks(self, block_ids: list[int]) -> None:
        """Sanitizer: freed blocks and state runs read as NaN, so a stale read shows up.
        Whole pages are filled with 0xFF bytes (NaN in every float dtype): a page may hold
        attention KV or a slice of a recurrent state spanning several pages."""
        if not block_ids:
            return
        ids = to_device(block_ids, torch.long, self.device)
        for pages in self.page_buffers:
            pages[ids] = 0xFF

    def copy_state_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copies pool pages src -> dst in every page buffer (a buffer holds layer i of
        whichever group owns the page): the pages of a linear-state checkpoint, or an
        attention block a prefix hit ends inside. The control plane lists every page of a
        state run."""
        if not pairs:
            return
        src = to_device([p[0] for p in pairs], torch.long, self.device)
        dst = to_device([p[1] for p in pairs], torch.long, self.device)
        for pages in self.page_buffers:
            pages[dst] = pages[src]

    # -- one step -------------------------------------------------------------------
    def build_batch(self, sched: SchedulerOutput):
        input_ids: list[int] = []
        starts, ends = [], []
        # (request id, token index of its last real query, drafts after it)
        sample_rows: list[tuple[str, int, list[int]]] = []
        # Tokens the previous step sampled that this worker has not been sent yet (a step
        # scheduled ahead): (index in input_ids, row of the previous step's samples).
        fill_from_device: list[tuple[int, int]] = []
        positions_of_samples: dict[str, int] = {}
        self.step_pending = {}
        self.step_history, self.step_drafts, self.step_draft_slots = {}, {}, {}
        self.step_row_drafts = []  # drafts each row verifies, in batch order (graph dispatch)
        requests = self.input_batch.requests
        for request_id, num_new in sched.num_scheduled_tokens.items():
            state = requests[request_id]
            scheduled_spec = sched.scheduled_spec_token_ids.get(request_id, [])
            start = state.num_computed_tokens
            tokens, pending, spec = state.token_ids, 0, scheduled_spec
            if self.speculative:
                # A step scheduled ahead: the scheduler's count assumed the previous
                # step's drafts were all accepted; the worker knows how it ended.
                unseen = self.spec_carry.unseen(request_id, len(tokens))
                if unseen:
                    start -= self.spec_carry.rejected[request_id]
                    tokens = state.token_ids + unseen
                spec = self._drafts_to_verify(request_id, scheduled_spec, bool(unseen))
            else:
                pending = self._pending_tokens(request_id, state)
                self.step_pending[request_id] = pending
            real_end = start + num_new - len(scheduled_spec)
            available = len(tokens) + pending
            if real_end > available:
                raise RuntimeError(
                    f"request {request_id}: step needs tokens up to {real_end}, the worker "
                    f"knows {len(tokens)} (+{pending} on the device)"
                )
            if real_end > len(tokens):  # the one token still on the device
                input_ids.extend(tokens[start : real_end - 1])
                fill_from_device.append((len(input_ids), self.prev_rows[request_id]))
                input_ids.append(0)
            else:
                input_ids.extend(tokens[start:real_end])
            if spec:
                input_ids.extend(spec)
            self.step_row_drafts.append(len(spec))
            starts.append(start)
            ends.append(real_end + len(spec))
            if real_end == available:
                sample_rows.append((request_id, len(input_ids) - 1 - len(spec), spec))
                positions_of_samples[request_id] = real_end
                if self.speculative:
                    self.step_history[request_id] = tokens
                    self.step_drafts[request_id] = spec
                    self.step_draft_slots[request_id] = len(scheduled_spec)
        start_array = np.array(starts, dtype=np.int64)
        end_array = np.array(ends, dtype=np.int64)
        query_start, positions, row_of_token = token_positions(start_array, end_array)
        # Two staged copies (int64, int32) carry every host array of the step.
        wide = [np.array(input_ids, dtype=np.int64), positions]
        narrow = [query_start, end_array, start_array]
        # Per group: (index in wide of its slots, of its state indices or None).
        where = []
        tables = self.input_batch.padded_tables(list(sched.num_scheduled_tokens), len(self.groups))
        for group, table in zip(self.groups, tables):
            narrow.append(table)
            if isinstance(group.spec, LinearStateSpec):
                # State lives in one page per request: no per-token slots. A row without
                # a page has 0 (the null block) first: its state index is -1.
                first = table[:, 0] if table.shape[1] else np.zeros(len(starts), np.int32)
                where.append((len(wide), len(wide) + 1))
                wide += [np.zeros(0, np.int64), np.where(first != 0, first, -1).astype(np.int64)]
            else:
                size = group.spec.block_size
                where.append((len(wide), None))
                wide.append(
                    slot_mapping(table, size, positions, row_of_token, self.dcp_size, self.dcp_rank)
                )
        if fill_from_device:
            wide.append(np.array([d for d, _ in fill_from_device], dtype=np.int64))
            wide.append(np.array([r for _, r in fill_from_device], dtype=np.int64))
        dev = self.device
        wide_t = to_device_packed(wide, torch.long, dev)
        narrow_t = to_device_packed(
            [a.astype(np.int32, copy=False) for a in narrow], torch.int32, dev
        )
        ids, positions_t = wide_t[0], wide_t[1]
        groups = []
        for g, (slots_at, state_at) in enumerate(where):
            meta = GroupMetadata(narrow_t[3 + g], wide_t[slots_at])
            if state_at is not None:
                meta.state_indices = wide_t[state_at]
            groups.append(meta)
        query_start_list = query_start.tolist()
        row_lens = (end_array - start_array).tolist()
        rows = RowClasses(classify_rows(starts, row_lens), row_lens)
        batch = ForwardBatch(
            positions=positions_t,
            query_start_loc=narrow_t[0],
            seq_lens=narrow_t[1],
            num_computed_tokens=narrow_t[2],
            query_start_loc_list=query_start_list,
            seq_lens_list=ends,
            rows=rows,
            groups=groups,
            layer_to_group=self.layer_to_group,
            decode_only=rows.uniform_decode(1) and len(input_ids) == len(row_lens),
        )
        if fill_from_device:
            dst, src = wide_t[-2], wide_t[-1]
            ids[dst] = self.prev_sampled[src]
        # Where each sampled token will sit in its request (read by the next step).
        self.prev_positions = positions_of_samples
        self.step_sample_positions = positions_of_samples
        return ids, batch, sample_rows

    def _drafts_to_verify(self, request_id: str, scheduled: list[int], in_flight: bool):
        """The drafts this step verifies: the scheduler's, or for placeholder slots the
        ones this worker proposed in the step before (as many as it has; slots left over
        count as rejected drafts, and the step's row is that much shorter)."""
        if not scheduled or scheduled[0] != PLACEHOLDER_TOKEN_ID:
            return scheduled
        if not in_flight:
            return []  # no step of ours is ahead of the scheduler's view: nothing proposed
        return self.spec_carry.drafts.get(request_id, [])[: len(scheduled)]

    def _slots(self, block_ids: list[int], block_size: int, start: int, end: int):
        """Cache slots of positions [start, end). Under DCP a rank writes only positions
        p % dcp_size == dcp_rank, at local index p // dcp_size (others get -1)."""
        if self.dcp_size == 1:
            return [
                block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)
            ]
        local = block_size // self.dcp_size
        return [
            block_ids[p // block_size] * local + (p // self.dcp_size) % local
            if p % self.dcp_size == self.dcp_rank
            else -1
            for p in range(start, end)
        ]

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(sched).result()

    @torch.inference_mode()
    def submit(self, sched: SchedulerOutput) -> PendingStep:
        """Launches the step; the sampled ids stay on the device until `result()`."""
        # The kernel plans' switch is process-wide: each engine's steps run under its own
        # mode, also when engines with and without it share this process.
        set_batch_invariant(self.config.model.deterministic)
        if self.awaiting_masks is not None:
            raise RuntimeError(
                f"step {sched.step_id} arrived while step {self.awaiting_masks.step_id} "
                "still waits for its grammar masks"
            )
        self.input_batch.apply(sched)
        # A request id may return (finished, then reused): its old positions mean nothing.
        for request_id in sched.finished_request_ids:
            self.prev_positions.pop(request_id, None)
            self.spec_carry.forget(request_id)
        for new in sched.new_requests:
            self.prev_positions.pop(new.request_id, None)
            self.spec_carry.forget(new.request_id)
        if self.config.cache.sanitize:
            self.poison_blocks(sched.blocks_to_poison)
        self.copy_state_pages(sched.state_copies_before)
        if sched.is_empty:
            return PendingStep(ready=ModelRunnerOutput({}))
        input_ids, batch, sample_rows = self.build_batch(sched)
        # Structured outputs: per request, one mask per sampled lane.
        self.step_bitmasks = sched.grammar_bitmasks
        hidden = self._forward(input_ids, batch)
        if self.speculative:
            out = self.sample_tokens(hidden, sample_rows)
            if self.draft is not None:
                self._run_drafter(sched, input_ids, batch, hidden, out)
            elif self.ngram is not None:
                self._propose_ngram(out)
            self._carry_over(out)
            pending = PendingStep(ready=out)
        else:
            pending = self._sample_plain(hidden, sample_rows, sched)
        # Checkpoints last: a drafter's linear state must have caught up with this step too.
        self.copy_state_pages(sched.state_copies_after)
        return pending

    def _forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The target's forward: a decode or (rows, k) verification graph where the one
        dispatch decision allows it (`graph_key_for`, invariant 3), else eager. A hybrid's
        state backup and restore are page copies around this call, outside any graph."""
        if self.graphs is not None:
            k = self.config.speculative.num_speculative_tokens if self.speculative else 0
            key = graph_key_for(
                batch.rows, self.step_row_drafts, input_ids.shape[0], self.graphs.sizes, k
            )
            if key is not None:
                size, drafts = key
                graphs = self.graphs if drafts == 0 else self.verify_graphs
                if graphs is not None:
                    return graphs.replay(size, input_ids, batch)
        return self.model(input_ids, batch.positions, batch)

    def _sample_plain(self, hidden: torch.Tensor, sample_rows, sched) -> PendingStep:
        """Samples one token per row on the device and remembers where each request's
        token is, so a step scheduled before this one is read back can use it. A step
        whose grammar masks follow samples when they arrive (`supply_bitmasks`). A step
        whose rows are all plain greedy (the offline benchmarks' every step) builds no
        per-row sampling state: the fused argmax is all the sampler would run for it."""
        requests = self.input_batch.requests
        plain = (
            not sched.grammar_bitmasks_follow
            and not self.step_bitmasks
            and all(requests[rid].plain_greedy for rid, _, _ in sample_rows)
        )
        rows = None if plain else [self._sampling_state(rid) for rid, _, _ in sample_rows]
        self.prev_sampled = None
        self.prev_rows = {}
        if not sample_rows:
            return PendingStep(ready=ModelRunnerOutput({}))
        index = to_device([i for _, i, _ in sample_rows], torch.long, hidden.device)
        logits = self.model.compute_logits(hidden[index])
        request_ids = [rid for rid, _, _ in sample_rows]
        if plain:
            return self._pending(greedy_argmax(logits), None, None, request_ids)
        if not sched.grammar_bitmasks_follow:
            return self._draw(logits, rows, request_ids)

        def sample(masks: dict[str, bytes]) -> PendingStep:
            for rid, row in zip(request_ids, rows):
                if rid in masks:
                    row.token_bitmask = masks[rid]
            return self._draw(logits, rows, request_ids)

        self.awaiting_masks = AwaitingMasksStep(sched.step_id, sample)
        return self.awaiting_masks

    @torch.inference_mode()
    def supply_bitmasks(self, masks: GrammarBitmasks) -> None:
        """The grammar masks the step launched last waits for: it samples now."""
        awaiting = self.awaiting_masks
        if awaiting is None:
            raise RuntimeError(f"GrammarBitmasks for step {masks.step_id}: no step waits for them")
        self.awaiting_masks = None
        awaiting.supply(masks)

    def _draw(self, logits, rows, request_ids) -> PendingStep:
        max_logprobs = max(
            [r.params.logprobs for r in rows if r.params.logprobs is not None], default=-1
        )
        tokens, raw_logprobs = sample_on_device(logits, rows, max_logprobs)
        return self._pending(tokens, raw_logprobs, rows, request_ids)

    def _pending(self, tokens, raw_logprobs, rows, request_ids) -> PendingStep:
        """Remembers where each request's token is (a step scheduled before this one is
        read back takes it from there) and hands the step's result out to be read later."""
        self.prev_sampled = tokens
        self.prev_rows = {rid: row for row, rid in enumerate(request_ids)}
        return PendingStep(
            request_ids=request_ids, tokens=tokens, raw_logprobs=raw_logprobs, rows=rows
        )

    def _carry_over(self, out: ModelRunnerOutput) -> None:
        """Leaves this step's outcome for a step scheduled behind it (SpecCarry), and
        tells the scheduler where fewer drafts were verified than it gave slots for."""
        carry = SpecCarry()
        for rid, emitted in out.sampled_token_ids.items():
            slots = self.step_draft_slots[rid]
            verified = len(self.step_drafts[rid])
            if verified < slots:
                out.num_draft_tokens[rid] = verified
            carry.first_position[rid] = self.step_sample_positions[rid]
            carry.emitted[rid] = emitted
            carry.rejected[rid] = slots - (len(emitted) - 1)
            carry.drafts[rid] = out.spec_token_ids.get(rid, [])
        self.spec_carry = carry

    def _propose_ngram(self, out: ModelRunnerOutput) -> None:
        """N-gram drafts from the worker's own token history, emitted tokens included."""
        k = self.config.speculative.num_speculative_tokens
        for rid, emitted in out.sampled_token_ids.items():
            out.spec_token_ids[rid] = self.ngram.propose(self.step_history[rid] + emitted, k)

    def _run_drafter(self, sched, input_ids, batch, hidden, out: ModelRunnerOutput) -> None:
        reqs = self.input_batch.requests
        step = DraftStep(
            request_ids=list(sched.num_scheduled_tokens),
            input_ids=input_ids,
            batch=batch,
            hidden=hidden,
            drafts=self.step_drafts,
            sampled=out.sampled_token_ids,
            finished=sched.finished_request_ids,
            # Every scheduled row's (a remote drafter rebuilds the whole batch from them).
            block_ids={rid: reqs[rid].block_ids for rid in sched.num_scheduled_tokens},
            num_tokens={rid: self.step_sample_positions[rid] for rid in out.sampled_token_ids},
            slots_fn=self._slots,
            groups=self.groups,
            k=self.config.speculative.num_speculative_tokens,
            # A prefill chunk short of the prompt's end: the prompt token after it.
            next_tokens={
                rid: reqs[rid].token_ids[end]
                for rid, end in zip(sched.num_scheduled_tokens, batch.seq_lens_list)
                if rid not in out.sampled_token_ids and end < len(reqs[rid].token_ids)
            },
        )
        out.spec_token_ids.update(self.draft.run(step))

    def _sampling_state(self, request_id: str, history: bool = False) -> RowSamplingState:
        """The row's sampling inputs. Token histories are copied only when read (penalties,
        draft verification); a token still on the device (a step scheduled ahead) counts
        towards the output position but cannot be in a history."""
        state = self.input_batch.requests[request_id]
        params = state.sampling_params
        pending = self.step_pending.get(request_id, 0)
        history = history or params.reads_token_history
        if history and pending and request_id not in self.prev_rows:
            raise RuntimeError(f"request {request_id}: its pending token is not on the device")
        return RowSamplingState(
            params,
            state.sampling_seed,
            state.token_ids[: state.num_prompt_tokens] if history else [],
            state.output_token_ids if history else [],
            num_output_tokens=len(state.token_ids) + pending - state.num_prompt_tokens,
            pending_token=self.prev_sampled[self.prev_rows[request_id]]
            if history and pending
            else None,
            token_bitmask=self.step_bitmasks.get(request_id),
        )

    def _history_state(self, request_id: str) -> RowSamplingState:
        """A speculative step's row: its full token history is on the host (the worker's
        tokens and the previous step's emitted ones), so penalties, seeded draws and
        verification read it as they do without async scheduling."""
        tokens = self.step_history.get(request_id)
        if tokens is None:  # not a speculative step (the memory profile's sampling)
            return self._sampling_state(request_id, history=True)
        state = self.input_batch.requests[request_id]
        return RowSamplingState(
            state.sampling_params,
            state.sampling_seed,
            tokens[: state.num_prompt_tokens],
            tokens[state.num_prompt_tokens :],
            token_bitmask=self.step_bitmasks.get(request_id),
        )

    def _pending_tokens(self, request_id: str, state) -> int:
        """1 when the request's newest token was sampled by the previous step and has not
        reached this worker's token list yet (the engine scheduled this step ahead)."""
        position = self.prev_positions.get(request_id)
        return 1 if position is not None and position >= len(state.token_ids) else 0

    def sample_tokens(self, hidden: torch.Tensor, sample_rows) -> ModelRunnerOutput:
        """One token for plain rows; verified drafts + one token for rows with drafts."""
        plain = [(rid, i) for rid, i, spec in sample_rows if not spec]
        drafted = [(rid, i, spec) for rid, i, spec in sample_rows if spec]
        out = ModelRunnerOutput({})
        if plain:
            index = to_device([i for _, i in plain], torch.long, hidden.device)
            logits = self.model.compute_logits(hidden[index])
            rows = [self._history_state(rid) for rid, _ in plain]
            max_logprobs = max(
                [r.params.logprobs for r in rows if r.params.logprobs is not None], default=-1
            )
            tokens, infos = sample(logits, rows, max_logprobs)
            for (rid, _), token, info in zip(plain, tokens, infos):
                out.sampled_token_ids[rid] = [token]
                if info is not None:
                    out.logprobs[rid] = [info]
        if drafted:
            self._verify_drafts(hidden, drafted, out)
        return out

    def _verify_drafts(self, hidden, drafted, out: ModelRunnerOutput) -> None:
        k = max(len(spec) for _, _, spec in drafted)
        # Row r's lanes are the logits at its last real token and at each draft; lanes past
        # its own draft count repeat its last index (padding the sampler never reads).
        index = [i + min(lane, len(spec)) for _, i, spec in drafted for lane in range(k + 1)]
        index = to_device(index, torch.long, hidden.device)
        logits = self.model.compute_logits(hidden[index]).view(len(drafted), k + 1, -1)
        draft_ids = to_device(
            [spec + [0] * (k - len(spec)) for _, _, spec in drafted], torch.long, hidden.device
        )
        rows = [self._history_state(rid) for rid, _, _ in drafted]
        target = logits
        if any(row.token_bitmask is not None for row in rows):
            target = logits.clone()  # logprobs stay the model's own
            apply_lane_bitmasks(target, rows)
        result = rejection_sample(target, draft_ids, [len(s) for _, _, s in drafted], rows)
        for (rid, _, _), tokens, row_logits in zip(drafted, result.tolist(), logits):
            out.sampled_token_ids[rid] = tokens
            top_n = self.input_batch.requests[rid].sampling_params.logprobs
            if top_n is not None:
                out.logprobs[rid] = logprob_infos(row_logits[: len(tokens)], tokens, top_n)
