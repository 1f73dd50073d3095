"""Plan a source for one worker: only the tensors its rank holds, in the engine's module names.

`plan_for_worker` is the single entry point every worker-side step (reload,
pre-flight, verify) plans through. With pipeline parallelism a rank holds only
its stage's decoder layers (vLLM puts a `PPMissingLayer` where the others
would be, and the embeddings or the head only on the first or last stage);
with expert parallelism an experts module holds only its rank's experts. A
tensor another rank holds is neither read nor an error here: its own rank
reads and checks it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from layerwise_cli import vllm_compat
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.planning.parents import LayerMapping, mapping_for_config
from layerwise_cli.planning.plan import Plan, PlannedTensor, build_plan

_EXPERT_ID_RE = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class RankPosition:
    """Where a worker sits in the engine's parallel layout."""

    rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    # The node this worker runs on, of an engine spread over `nnodes` nodes (`layerwise serve --nnodes`).
    node_rank: int = 0
    nnodes: int = 1

    def to_dict(self) -> dict:
        """The position as JSON; the node only for an engine spread over several."""
        spread = {"node_rank": self.node_rank, "nnodes": self.nnodes} if self.nnodes > 1 else {}
        return {"rank": self.rank, "tp_rank": self.tp_rank, "tp_size": self.tp_size, "pp_rank": self.pp_rank,
                "pp_size": self.pp_size, "dp_rank": self.dp_rank, "dp_size": self.dp_size, **spread}


def rank_position(worker=None) -> RankPosition:
    """This worker's position, read from vLLM's process groups (all zeros outside a vLLM worker)."""
    try:
        ps = vllm_compat.parallel_state()
    except Exception:  # noqa: BLE001 - no vLLM: a single process
        return RankPosition()

    def group(getter) -> tuple[int, int]:
        try:
            coordinator = getter()
            return coordinator.rank_in_group, coordinator.world_size
        except Exception:  # noqa: BLE001 - group not initialised: a single rank
            return 0, 1

    tp_rank, tp_size = group(ps.get_tp_group)
    pp_rank, pp_size = group(ps.get_pp_group)
    parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    if parallel is not None:
        # vLLM runs the engines of a dense model as independent DP=1 engines (`reconfigure_for_independent_
        # dp_rank`): only `data_parallel_index` keeps the engine's index there (and its size is then 1).
        index = getattr(parallel, "data_parallel_index", None)
        dp_rank = int(index if index is not None else parallel.data_parallel_rank or 0)
        dp_size = max(int(parallel.data_parallel_size or 1), dp_rank + 1)
        node_rank, nnodes = int(getattr(parallel, "node_rank", 0) or 0), int(getattr(parallel, "nnodes", 1) or 1)
    else:
        dp_rank, dp_size = group(ps.get_dp_group)
        node_rank, nnodes = 0, 1
    rank = getattr(worker, "rank", None)
    return RankPosition(rank=int(rank) if rank is not None else 0, tp_rank=tp_rank, tp_size=tp_size,
                        pp_rank=pp_rank, pp_size=pp_size, dp_rank=dp_rank, dp_size=dp_size, node_rank=node_rank,
                        nnodes=nnodes)


@dataclass(frozen=True)
class WorkerPlan:
    """What one worker streams: its rank's tensors, planned, with the engine module each one feeds."""

    plan: Plan  # the rank-local plan (tensors other ranks hold are not in it)
    vllm_names: dict[str, str]  # checkpoint tensor -> engine module that buffers it (this rank's tensors)
    position: RankPosition
    elsewhere_tensors: int  # tensors of SOURCE that other ranks hold (not read here)
    elsewhere_bytes: int
    reference: Checkpoint | None  # the engine's starting checkpoint, cut to this rank's tensors

    def engine_stream(self, order: str = "layer") -> list[PlannedTensor]:
        """This rank's tensors in `order` (`layer` or `file`), each with the engine module that buffers it."""
        stream = self.plan.layer_order if order == "layer" else self.plan.file_order
        return [replace(item, parent=self.vllm_names.get(item.entry.name)) for item in stream]

    def parent_engine_names(self) -> dict[str, str]:
        """Each of the plan's parent layers (checkpoint names) -> the engine module that buffers it."""
        return {item.parent: self.vllm_names.get(item.entry.name, item.parent)
                for item in self.plan.layer_order if item.parent is not None}


def plan_for_worker(checkpoint: Checkpoint, model: torch.nn.Module, hf_config: dict | None,
                    position: RankPosition | None = None, reference: Checkpoint | None = None) -> WorkerPlan:
    """Plan CHECKPOINT for the worker holding MODEL: only the tensors this rank holds.

    Args:
        checkpoint: the source's headers.
        model: this worker's model (its modules say which layers the rank holds).
        hf_config: the engine's config, used when the source has none.
        position: this worker's place in the parallel layout (default: read from vLLM).
        reference: the engine's starting checkpoint, cut to this rank too (for pre-flight).

    Returns:
        The rank-local plan and the engine module of each of its tensors.
    """
    position = position or rank_position()
    config = checkpoint.config or hf_config
    # The engine's own model class: its loader's skip rules are the ones that apply here.
    model_cls = type(model) if type(model).__module__.startswith("vllm.") else None
    modules = dict(model.named_modules()) if hasattr(model, "named_modules") else {}
    mapping = mapping_for_config(config, "auto", model_cls=model_cls).for_tensors(
        t.name for t in checkpoint.tensors).for_engine(modules)
    owner = _Ownership(model, modules, mapping)
    local, elsewhere = owner.split(checkpoint)
    plan = build_plan(_cut(checkpoint, local), mapping, position.tp_size,
                      vocabulary_layers=owner.vocabulary_parents() if modules else None)
    vllm_names = {name: module for name, module in owner.engine_names.items() if name in local}
    cut_reference = None
    if reference is not None:
        ref_local, _ = owner.split(reference)
        cut_reference = _cut(reference, ref_local)
    return WorkerPlan(plan, vllm_names, position, len(elsewhere), sum(e.nbytes for e in elsewhere), cut_reference)


class _Ownership:
    """Which checkpoint tensors this rank holds, and the engine module each one feeds."""

    def __init__(self, model: torch.nn.Module, modules: dict[str, torch.nn.Module], mapping: LayerMapping) -> None:
        self._mapping = mapping
        self._mapper = getattr(model, "hf_to_vllm_mapper", None)
        self._modules = modules
        self._aliases = _aliases(model, modules)
        self._missing = tuple(name for name, module in modules.items() if _is_missing_layer(module))
        self._resolved: dict[str, str] = {}
        self.engine_names: dict[str, str] = {}

    def split(self, checkpoint: Checkpoint) -> tuple[set[str], list]:
        local: set[str] = set()
        elsewhere = []
        for entry in checkpoint.tensors:
            name = entry.name
            if self._mapping.skip_reason(name) is not None:
                local.add(entry.name)  # skipped by the engine on every rank; kept for the plan's accounting
                continue
            if self._mapper is not None:
                # The mapper's per-name API (`_map_name` before vLLM 0.32); None: the model drops the name.
                map_name = getattr(self._mapper, "map_name", None) or self._mapper._map_name
                name = map_name(name)
                if name is None:
                    local.add(entry.name)
                    continue
            parent = self._mapping.parent_of(name)
            if parent is None:
                local.add(entry.name)
                continue
            module_name = self._resolve(parent.name)
            if self._modules and not takes_checkpoint_tensors(self._modules.get(module_name)):
                # Not a module of this engine: the model's loader may rename it itself (Granite-4's fused experts).
                module_name = next((renamed for renamed in map(self._resolve_name,
                                                               self._mapping.renamed_candidates(name))
                                    if renamed is not None and takes_checkpoint_tensors(self._modules.get(renamed))),
                                   module_name)
            if self._on_other_rank(module_name, name):
                elsewhere.append(entry)
                continue
            self.engine_names[entry.name] = module_name
            local.add(entry.name)
        return local, elsewhere

    def vocabulary_parents(self) -> set[str]:
        """The parent layers (checkpoint names) whose engine module is vocabulary-parallel: vLLM pads those.

        A vocabulary-parallel module (`VocabParallelEmbedding`, `ParallelLMHead`) knows its padded size.
        """
        return {parent.name for tensor, module in self.engine_names.items()
                if hasattr(self._modules.get(module), "num_embeddings_padded")
                and (parent := self._mapping.parent_of(tensor)) is not None}

    def _resolve(self, parent: str) -> str:
        parent = self._aliases.get(parent, parent)
        if parent not in self._resolved:
            self._resolved[parent] = holder_of_parameters(self._modules, parent) if self._modules else parent
        return self._resolved[parent]

    def _resolve_name(self, tensor_name: str) -> str | None:
        parent = self._mapping.parent_of(tensor_name)
        return self._resolve(parent.name) if parent is not None else None

    def _on_other_rank(self, module_name: str, tensor_name: str) -> bool:
        # Another pipeline stage's layer: the module, or one above it, is vLLM's placeholder.
        if any(module_name == m or module_name.startswith(m + ".") for m in self._missing):
            return True
        # Another expert-parallel rank's expert: vLLM's experts module maps it to no local slot.
        module = self._modules.get(module_name)
        local_id = getattr(module, "_map_global_expert_id_to_local_expert_id", None)
        match = _EXPERT_ID_RE.search(tensor_name)
        if local_id is None or match is None or not _expert_parallel(module) or "input_scale" in tensor_name:
            return False
        try:
            return local_id(int(match.group(1))) == -1
        except Exception:  # noqa: BLE001 - cannot tell: read it, vLLM's loader decides
            return False


def _aliases(model: torch.nn.Module, modules: dict[str, torch.nn.Module]) -> dict[str, str]:
    """Second names of modules registered twice -> the name `named_modules()` gives them (the engine's name).

    vLLM's Transformers backend registers an MoE block's router both where the checkpoint has it (`mlp.gate`)
    and inside its experts runner (`mlp.experts.gate`); `named_modules()` lists it once, under the name met first.
    """
    if not hasattr(model, "named_modules"):
        return {}
    first = {id(module): name for name, module in modules.items()}
    return {name: first[id(module)] for name, module in model.named_modules(remove_duplicate=False)
            if name not in modules and id(module) in first}


def holds_parameters(module: torch.nn.Module | None) -> bool:
    """Whether MODULE has parameters of its own (not only in its sub-modules)."""
    return module is not None and any(True for _ in module.parameters(recurse=False))


def takes_checkpoint_tensors(module: torch.nn.Module | None) -> bool:
    """Whether MODULE loads checkpoint tensors of its own: a parameter, or a persistent buffer.

    vLLM's loader (`AutoWeightsLoader`) loads a module's persistent buffers as it loads its parameters, and its
    reload counts both towards the module's completion (`get_layer_size`): a container module that owns one
    (Gemma 4's decoder layer and its `layer_scalar`) is a parent layer of its own. Buffers vLLM derives
    (non-persistent: a rotary cache) take nothing from a checkpoint.
    """
    if module is None:
        return False
    if holds_parameters(module):
        return True
    derived = getattr(module, "_non_persistent_buffers_set", set())
    return any(name not in derived for name, _ in module.named_buffers(recurse=False))


def _is_missing_layer(module: torch.nn.Module) -> bool:
    """vLLM's placeholder for a layer another pipeline stage holds."""
    return type(module).__name__ in ("PPMissingLayer", "StageMissingLayer")


def _expert_parallel(module) -> bool:
    config = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
    return bool(getattr(config, "use_ep", False))


def _cut(checkpoint: Checkpoint, keep: set[str]) -> Checkpoint:
    """CHECKPOINT with only the tensors named in KEEP (shards kept, emptied where nothing is left)."""
    shards = [replace(shard, tensors=[t for t in shard.tensors if t.name in keep]) for shard in checkpoint.shards]
    return replace(checkpoint, shards=shards)


def holder_of_parameters(modules: dict[str, torch.nn.Module], name: str) -> str:
    """The module that holds the parameters for parent NAME.

    Usually NAME itself. Some vLLM modules delegate to one child that owns the
    weights (vLLM 0.32's `MoERunner` at `mlp.experts` keeps them in
    `mlp.experts.routed_experts`); then that child is the layer vLLM buffers.
    """
    module = modules.get(name)
    if module is None or takes_checkpoint_tensors(module):
        return name
    holders = [child for child, sub in modules.items() if child.startswith(name + ".") and holds_parameters(sub)]
    if len(holders) > 1 and name.rpartition(".")[2] == "experts":
        # vLLM's Transformers backend puts the router beside the experts (`mlp.experts.gate`,
        # `mlp.experts.routed_experts`): the experts' tensors go to the module that maps experts to its slots.
        holders = [child for child in holders if callable(getattr(modules[child], "get_expert_mapping", None))]
    return holders[0] if len(holders) == 1 else name
