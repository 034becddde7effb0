"""The DPO stage's config: its flags, their defaults and the combinations it refuses."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from stages.config import (
    PARAMETERS_IN_HOST_MEMORY, OfflineTrainingConfig, OutputPath, PolicyPath, PreferenceKeys, RouterBalancing,
    ckpt_path_field, learning_rate_field, max_len_field,
)
from stages.fields import GpuOnly


class DPOConfig(PreferenceKeys, RouterBalancing, OfflineTrainingConfig):
    """Direct preference optimisation (and IPO, cDPO): `python -m stages.dpo`."""

    stage = "dpo"
    trains_policy = True
    tiny_rows = "pref"
    tiny_assets = {"pretrain": "model", "dataset": "pref_train", "eval_dataset": "pref_eval"}

    pretrain: PolicyPath = Field(None, description="policy to train, usually the SFT model")
    ref_pretrain: PolicyPath = Field(None, description="frozen reference model; unset: a copy of --pretrain")
    ckpt_path: OutputPath = ckpt_path_field("./ckpt/checkpoints_dpo")
    learning_rate: float = learning_rate_field(1e-5)
    max_len: int | None = max_len_field(512)
    beta: float = Field(0.1, gt=0, description="strength of the implicit KL constraint to the reference")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="cDPO: assumed probability that a preference label is flipped",
    )
    ipo: bool = Field(False, description="use the IPO loss instead of the DPO sigmoid loss")
    nll_loss_coef: float = Field(0.0, ge=0, description="weight of an NLL loss on the chosen response")
    ref_offload: Annotated[bool, GpuOnly(False, PARAMETERS_IN_HOST_MEMORY)] = Field(
        False, description="keep the reference model's ZeRO-3 partitions in host memory, fetched layer by layer for "
        "its forwards (needs --zero_stage 3)",
    )

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.ipo and self.label_smoothing > 0:
            problems.append("--label_smoothing applies to the DPO loss only; drop it or --ipo")
        if self.ref_offload and self.zero_stage != 3:
            problems.append(f"--ref_offload offloads ZeRO-3 partitions: it needs --zero_stage 3, got {self.zero_stage}")
        return problems

    def validate_rows(self, rows, source: str) -> None:
        """The schema check of the rows this stage trains on (the stage's and the plan's): exit 2 naming the row."""
        from stages import data

        data.validate_preference(rows, source, self.prompt_key, self.chosen_key, self.rejected_key,
                                 apply_chat_template=self.apply_chat_template)
