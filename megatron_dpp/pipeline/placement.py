"""Stage placement: which pipeline rank holds each virtual stage, as data.

A model cut into S virtual stages runs on P ranks, V = S / P stages (local model chunks) per rank.
A rank numbers its chunks in stage order (chunk 0 is its shallowest stage), so on every rank the
chunks finish their backwards deepest first, V-1, ..., 0, whatever the placement. Everything that
asks "which stage is this chunk", "where does this output go" or "is this the loss stage" asks a
`Placement`; nothing else computes stage positions (tests/test_placement.py guards that).

- `interleaved(P, V)`: Megatron-Core's placement, chunk c on rank r is stage c*P + r (the
  default; V=1 is plain 1F1B's one stage per rank).
- `v_shape(P)`: the V of ZB-V (torch's ScheduleZBVZeroBubble, ScheduleDualPipeV): two chunks per
  rank, chunk 0 on ranks 0..P-1 is stages 0..P-1, chunk 1 on ranks P-1..0 is stages P..2P-1. Stage
  P-1 and stage P are both on rank P-1 (the last forward's output stays on its rank) and rank 0
  holds both the first and the last stage.
- `from_stage_ranks(stage_ranks)`: any placement, given as the rank of each stage (what a
  schedule file implies, pipeline/schedule_csv.py).

Text form (`str`, `parse_placement`): 'interleaved:4x2' (P=4, V=2), 'v:4' (P=4), or
'ranks:0,1,1,0' (the rank of each stage) for any other.
"""
from __future__ import annotations

import dataclasses

INTERLEAVED = "interleaved"
V_SHAPE = "v"
CUSTOM = "custom"
# The placements the runtime builds models for, by name (--dpp-stage-placement).
PLACEMENT_NAMES = (INTERLEAVED, V_SHAPE)


def _interleaved_ranks(P: int, V: int) -> tuple[int, ...]:
    return tuple(stage % P for stage in range(P * V))


def _v_ranks(P: int) -> tuple[int, ...]:
    return tuple(range(P)) + tuple(reversed(range(P)))


@dataclasses.dataclass(frozen=True)
class Placement:
    """The rank of every virtual stage; everything else is derived from it."""

    stage_ranks: tuple[int, ...]
    """stage_ranks[s] is the pipeline rank that holds virtual stage s. Every rank 0..P-1 holds the
    same number V of stages; its local chunk c is the c-th of them in stage order."""

    P: int = dataclasses.field(init=False, repr=False)
    """Pipeline ranks."""

    V: int = dataclasses.field(init=False, repr=False)
    """Virtual stages (local model chunks) per rank."""

    name: str = dataclasses.field(init=False, repr=False)
    """'interleaved' or 'v' when stage_ranks is that placement, else 'custom'."""

    _stages_of_rank: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, repr=False, compare=False)
    _locations: tuple[tuple[int, int], ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        ranks = tuple(self.stage_ranks)
        if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise ValueError(f"placement: stage_ranks must be a non-empty list of ranks, got {self.stage_ranks!r}")
        P = max(ranks) + 1
        held = [[s for s, r in enumerate(ranks) if r == rank] for rank in range(P)]
        counts = sorted({len(stages) for stages in held})
        if min(ranks) < 0 or counts[0] == 0 or len(counts) != 1:
            raise ValueError(f"placement: every rank 0..{P - 1} must hold the same number of stages, "
                             f"got stage ranks {list(ranks)}")
        V = counts[0]
        locations = [None] * len(ranks)
        for rank, stages in enumerate(held):
            for chunk, stage in enumerate(stages):
                locations[stage] = (rank, chunk)
        if ranks == _interleaved_ranks(P, V):
            name = INTERLEAVED
        elif V == 2 and ranks == _v_ranks(P):
            name = V_SHAPE
        else:
            name = CUSTOM
        set_field = object.__setattr__  # frozen: derived fields are set once, here
        set_field(self, "stage_ranks", ranks)
        set_field(self, "P", P)
        set_field(self, "V", V)
        set_field(self, "name", name)
        set_field(self, "_stages_of_rank", tuple(tuple(stages) for stages in held))
        set_field(self, "_locations", tuple(locations))

    # --- the ends of the pipeline ---------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def first_stage(self) -> int:
        """The stage that reads the input data."""
        return 0

    @property
    def last_stage(self) -> int:
        """The stage that computes the loss (its backwards need no incoming gradient)."""
        return self.num_stages - 1

    def embedding_stages(self, tied_embeddings: bool) -> tuple[int, ...]:
        """Stages that hold a word embedding: the first; with tied input and output embeddings
        also the last (its output layer shares the embedding's weight)."""
        if tied_embeddings and self.last_stage != self.first_stage:
            return (self.first_stage, self.last_stage)
        return (self.first_stage,)

    # --- stage <-> (rank, chunk) ----------------------------------------------------------------
    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage of `rank`'s local `chunk`."""
        if not (0 <= rank < self.P and 0 <= chunk < self.V):
            raise ValueError(f"placement {self}: no chunk {chunk} on rank {rank} (P={self.P}, V={self.V})")
        return self._stages_of_rank[rank][chunk]

    def location(self, stage: int) -> tuple[int, int]:
        """(rank, local chunk) that holds virtual stage `stage`."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"placement {self}: no stage {stage} (it has {self.num_stages})")
        return self._locations[stage]

    def local_chunk(self, rank: int, stage: int) -> int | None:
        """The chunk of `rank` that is `stage`, or None when another rank holds it."""
        holder, chunk = self.location(stage)
        return chunk if holder == rank else None

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` holds, in stage order: stages_of(rank)[c] is its chunk c."""
        if not 0 <= rank < self.P:
            raise ValueError(f"placement {self}: no rank {rank} (P={self.P})")
        return self._stages_of_rank[rank]

    def chunks_deepest_first(self, rank: int) -> tuple[int, ...]:
        """`rank`'s chunks in the order their backwards finish: the deepest stage first (the
        backward of stage s waits for that of s+1)."""
        stages = self.stages_of(rank)
        return tuple(sorted(range(len(stages)), key=lambda chunk: -stages[chunk]))

    # --- neighbours -----------------------------------------------------------------------------
    def previous_stage(self, stage: int) -> int | None:
        """The stage whose forward output `stage` reads (None for the first stage)."""
        self.location(stage)  # a stage outside the pipeline is a ValueError
        return stage - 1 if stage > self.first_stage else None

    def next_stage(self, stage: int) -> int | None:
        """The stage that reads `stage`'s forward output (None for the last stage)."""
        self.location(stage)  # a stage outside the pipeline is a ValueError
        return stage + 1 if stage < self.last_stage else None

    def previous_on_same_rank(self, stage: int) -> bool:
        """Is the previous stage on the same rank (its output arrives without a message)?"""
        previous = self.previous_stage(stage)
        return previous is not None and self.stage_ranks[previous] == self.stage_ranks[stage]

    def next_on_same_rank(self, stage: int) -> bool:
        """Is the next stage on the same rank?"""
        following = self.next_stage(stage)
        return following is not None and self.stage_ranks[following] == self.stage_ranks[stage]

    # --- text form ------------------------------------------------------------------------------
    def __str__(self) -> str:
        if self.name == INTERLEAVED:
            return f"{INTERLEAVED}:{self.P}x{self.V}"
        if self.name == V_SHAPE:
            return f"{V_SHAPE}:{self.P}"
        return "ranks:" + ",".join(map(str, self.stage_ranks))


def interleaved(P: int, V: int = 1) -> Placement:
    """Megatron-Core's placement: chunk c on rank r is virtual stage c*P + r."""
    if P < 1 or V < 1:
        raise ValueError(f"interleaved placement needs P, V >= 1, got P={P} V={V}")
    return Placement(_interleaved_ranks(P, V))


def v_shape(P: int) -> Placement:
    """ZB-V's placement: chunk 0 of ranks 0..P-1 is stages 0..P-1, chunk 1 of ranks P-1..0 is
    stages P..2P-1."""
    if P < 1:
        raise ValueError(f"v placement needs P >= 1, got P={P}")
    return Placement(_v_ranks(P))


def named_placement(name: str, P: int, V: int) -> Placement:
    """The placement PLACEMENT_NAMES calls `name` for P ranks of V chunks each."""
    if name == INTERLEAVED:
        return interleaved(P, V)
    if name == V_SHAPE:
        if V != 2:
            raise ValueError(f"the v placement holds two model chunks per rank, got V={V}")
        return v_shape(P)
    raise ValueError(f"unknown stage placement {name!r}; choose one of {', '.join(PLACEMENT_NAMES)}")


def from_stage_ranks(stage_ranks) -> Placement:
    """Any placement, given as the rank of each stage, stage 0 first."""
    return Placement(tuple(stage_ranks))


def parse_placement(text: str) -> Placement:
    """The placement `str(placement)` printed: 'interleaved:4x2', 'v:4' or 'ranks:0,1,1,0'."""
    kind, _, rest = text.strip().partition(":")
    try:
        if kind == INTERLEAVED:
            P, _, V = rest.partition("x")
            return interleaved(int(P), int(V))
        if kind == V_SHAPE:
            return v_shape(int(rest))
        if kind == "ranks":
            return from_stage_ranks(int(r) for r in rest.split(","))
    except ValueError as error:
        if "placement" in str(error):
            raise
    raise ValueError(f"not a placement: {text!r}; expected 'interleaved:PxV', 'v:P' or "
                     "'ranks:r0,r1,...' (the rank of each stage)")
