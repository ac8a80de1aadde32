"""How the transformer layers split over pipeline stages, as Megatron-LM splits them.

Evenly by default. Megatron-LM's flags make the split uneven, because the first stage also runs the
embedding and the last one the output layer and the loss:
- `--decoder-first-pipeline-num-layers N` / `--decoder-last-pipeline-num-layers N`: the first / last
  stage gets N layers, and the other stages share the rest evenly;
- `--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split`: the
  embedding / the loss counts as one layer of an even split, so the first / last stage builds one
  transformer layer less;
- `--pipeline-model-parallel-layout` (e.g. `Et|tt|t|tL`): every stage's layers spelled out, the
  virtual stages too (Megatron-Core's PipelineParallelLayerLayout parses and validates it; here
  `layout` holds the transformer layers it gives each chunk).

`PipelineSplit.check` applies Megatron-Core's rules (TransformerConfig.__post_init__ and
get_num_layers_to_build) before anything starts, each broken rule as one line naming the flags;
`chunk_layers` gives the layers each model chunk builds, Megatron-Core's count.
tests/test_pipeline_split.py holds both to Megatron-Core's over a grid of layouts. Megatron-Core
builds the layers itself (TransformerBlock, with their global layer numbers): this module only
checks and counts. Standard library only: the memory model (models/memory_model.py) and the flag
checks import it without torch.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_dpp.flag_errors import first_given, require

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"


@dataclasses.dataclass(frozen=True)
class PipelineSplit:
    """The split of `num_layers` transformer layers over `pipeline_size` ranks, `virtual_size`
    model chunks each (None: one)."""

    num_layers: int
    pipeline_size: int
    virtual_size: Optional[int] = None
    first: Optional[int] = None  # layers on the first stage (--decoder-first-pipeline-num-layers)
    last: Optional[int] = None  # layers on the last stage (--decoder-last-pipeline-num-layers)
    embedding_is_a_layer: bool = False  # --account-for-embedding-in-pipeline-split
    loss_is_a_layer: bool = False  # --account-for-loss-in-pipeline-split
    # --pipeline-model-parallel-layout: transformer layers per [pipeline rank][virtual stage]
    layout: Optional[tuple[tuple[int, ...], ...]] = None

    @classmethod
    def from_config(cls, config: Any) -> "PipelineSplit":
        """From a TransformerConfig (or anything with its field names)."""
        return cls(num_layers=config.num_layers,
                   pipeline_size=getattr(config, "pipeline_model_parallel_size", 1) or 1,
                   virtual_size=getattr(config, "virtual_pipeline_model_parallel_size", None),
                   first=getattr(config, "num_layers_in_first_pipeline_stage", None),
                   last=getattr(config, "num_layers_in_last_pipeline_stage", None),
                   embedding_is_a_layer=bool(
                       getattr(config, "account_for_embedding_in_pipeline_split", False)),
                   loss_is_a_layer=bool(getattr(config, "account_for_loss_in_pipeline_split",
                                                False)),
                   layout=layout_layers(getattr(config, "pipeline_model_parallel_layout", None)))

    @property
    def uneven(self) -> bool:
        """The first or last stage's count is given."""
        return self.first is not None or self.last is not None

    @property
    def is_default(self) -> bool:
        """Megatron-LM's default, an even split of the layers alone."""
        return not (self.uneven or self.embedding_is_a_layer or self.loss_is_a_layer
                    or self.layout is not None)

    def rank_layers(self) -> list[int]:
        """Layers (in the even-split case: layer slots, the embedding and loss counted) of each
        pipeline rank, before the virtual split; call check() first."""
        pp = self.pipeline_size
        if self.uneven:
            middle_stages = pp - (self.first is not None) - (self.last is not None)
            middle_layers = self.num_layers - (self.first or 0) - (self.last or 0)
            each = middle_layers // middle_stages if middle_stages > 0 else 0
            counts = [each] * pp
            if self.first is not None:
                counts[0] = self.first
            if self.last is not None:
                counts[-1] = self.last
            return counts
        return [self._slots() // pp] * pp

    def _slots(self) -> int:
        return self.num_layers + self.embedding_is_a_layer + self.loss_is_a_layer

    def chunk_layers(self) -> list[list[int]]:
        """Transformer layers each model chunk builds: [pipeline rank][virtual stage], as
        Megatron-Core's get_num_layers_to_build; call check() first."""
        if self.layout is not None:
            return [list(rank) for rank in self.layout]
        vpp = self.virtual_size or 1
        chunks = [[count // vpp] * vpp for count in self.rank_layers()]
        if self.embedding_is_a_layer:
            chunks[0][0] -= 1
        if self.loss_is_a_layer:
            chunks[-1][-1] -= 1
        return chunks

    def largest_chunk(self) -> int:
        """The most transformer layers any model chunk builds."""
        return max(max(rank) for rank in self.chunk_layers())

    def check(self) -> None:
        """Megatron-Core's rules for this split; ArgsError with one line naming the flags."""
        pp, vpp = self.pipeline_size, self.virtual_size
        virtual = f" x {vpp} virtual stages" if vpp else ""
        if self.layout is not None:
            other = first_given(((FIRST_FLAG, self.first is not None),
                                 (LAST_FLAG, self.last is not None),
                                 (EMBEDDING_FLAG, self.embedding_is_a_layer),
                                 (LOSS_FLAG, self.loss_is_a_layer)))
            require(other is None, f"{LAYOUT_FLAG} places every layer itself; remove {other}")
            built = sum(sum(rank) for rank in self.layout)
            require(built == self.num_layers,
                    f"{LAYOUT_FLAG} places {built} transformer layers ('t'), --num-layers is "
                    f"{self.num_layers}")
            return
        if self.uneven:
            require(not (self.embedding_is_a_layer or self.loss_is_a_layer),
                    f"{FIRST_FLAG} / {LAST_FLAG} do not go with {EMBEDDING_FLAG} / {LOSS_FLAG} "
                    f"(Megatron-Core refuses the pair); give one kind of split")
            given_flags = [flag for flag, count in ((FIRST_FLAG, self.first), (LAST_FLAG, self.last))
                           if count is not None]
            require(pp > 1, f"{given_flags[0]} splits layers over pipeline stages; set "
                            f"--pipeline-model-parallel-size 2 or more, or remove it")
            for flag, count in ((FIRST_FLAG, self.first), (LAST_FLAG, self.last)):
                if count is None:
                    continue
                require(count > 0, f"{flag} {count}: a stage needs at least one layer")
                require(vpp is None or count % vpp == 0,
                        f"{flag} {count} is not divisible by the {vpp} virtual stages per "
                        f"pipeline rank; give a multiple of {vpp}")
            middle_stages = pp - (self.first is not None) - (self.last is not None)
            middle_layers = self.num_layers - (self.first or 0) - (self.last or 0)
            given = " + ".join(f"{flag} {count}" for flag, count in
                               ((FIRST_FLAG, self.first), (LAST_FLAG, self.last))
                               if count is not None)
            leave = "leave" if len(given_flags) > 1 else "leaves"
            if middle_stages == 0:
                require(middle_layers == 0,
                        f"{given} {leave} {middle_layers} of --num-layers {self.num_layers} for no "
                        f"other stage (--pipeline-model-parallel-size {pp}); make the two add up "
                        f"to {self.num_layers}")
                return
            others = ("the other pipeline stage" if middle_stages == 1
                      else f"the other {middle_stages} pipeline stages")
            require(middle_layers >= middle_stages,
                    f"{given} {leave} {middle_layers} of --num-layers {self.num_layers} for "
                    f"{others}; each needs at least one layer")
            require(middle_layers % middle_stages == 0,
                    f"{given} {leave} {middle_layers} of --num-layers {self.num_layers} for "
                    f"{others}, which do not split them evenly; give counts that leave a "
                    f"multiple of {middle_stages}")
            each = middle_layers // middle_stages
            require(vpp is None or each % vpp == 0,
                    f"{given} {leave} {each} layers on each other pipeline stage, not divisible "
                    f"by the {vpp} virtual stages per pipeline rank")
            return
        slots = self._slots()
        layers = f"--num-layers {self.num_layers}"
        if slots != self.num_layers:
            counted = [flag for flag, on in ((EMBEDDING_FLAG, self.embedding_is_a_layer),
                                             (LOSS_FLAG, self.loss_is_a_layer)) if on]
            layers += f" + {slots - self.num_layers} ({' and '.join(counted)}) = {slots} layers"
        require(slots % pp == 0,
                f"{layers} is not divisible by --pipeline-model-parallel-size {pp}; change "
                f"--num-layers" + (f", or split unevenly with {FIRST_FLAG} / {LAST_FLAG}"
                                   if slots == self.num_layers else ""))
        require(vpp is None or (slots // pp) % vpp == 0,
                f"{layers} is not divisible by pipeline ({pp}){virtual}; use a multiple of "
                f"{pp * vpp if vpp else pp} layers")

    def describe(self) -> str:
        """One line: the transformer layers of each pipeline rank (per chunk with virtual
        stages), e.g. `1 | 3` or `1+1 | 2+2`."""
        return " | ".join("+".join(str(count) for count in rank) for rank in self.chunk_layers())


def layout_layers(layout: Any) -> Optional[tuple[tuple[int, ...], ...]]:
    """The transformer layers per [pipeline rank][virtual stage] of Megatron-Core's parsed
    PipelineParallelLayerLayout (its `.layout` holds each chunk's LayerType list), or None."""
    if layout is None:
        return None
    return tuple(tuple(sum(1 for layer in chunk if getattr(layer, "name", layer) == "decoder")
                       for chunk in rank) for rank in layout.layout)
