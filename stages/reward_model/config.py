"""The reward model stage's config: its flags, their defaults and the combinations it refuses."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.config import (
    BaseModelPath, OfflineTrainingConfig, OutputPath, PreferenceKeys, RouterBalancing, ckpt_path_field,
    learning_rate_field, max_len_field, micro_train_batch_size_field,
)

MARGIN_COLUMN = "margin"  # OpenRLHF's column name for --margin_loss


class RewardModelConfig(PreferenceKeys, RouterBalancing, OfflineTrainingConfig):
    """Reward model on preference pairs: `python -m stages.reward_model` (OpenRLHF's train_rm)."""

    stage = "reward_model"
    tiny_rows = "pref"
    tiny_assets = {"pretrain": "model", "dataset": "pref_train", "eval_dataset": "pref_eval"}

    pretrain: BaseModelPath = Field(None, description="model the reward model starts from, usually the SFT model")
    ckpt_path: OutputPath = ckpt_path_field("./ckpt/checkpoints_rm")
    learning_rate: float = learning_rate_field(9e-6)
    micro_train_batch_size: int = micro_train_batch_size_field(1)
    max_len: int | None = max_len_field(512)
    loss: Literal["sigmoid", "logexp"] = Field(
        "sigmoid", description="pairwise loss: sigmoid (-log σ(r_c - r_r)) or logexp (log(1 + exp(r_r - r_c)))",
    )
    margin_loss: bool = Field(False, description="subtract the dataset's margin column inside the pairwise loss")

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.margin_loss and self.loss != "sigmoid":
            problems.append(f"--margin_loss needs --loss sigmoid (the {self.loss} loss has no margin term)")
        return problems

    def validate_rows(self, rows, source: str) -> None:
        """The schema check of the rows this stage trains on (the stage's and the plan's): exit 2 naming the row."""
        from stages import data

        data.validate_preference(rows, source, self.prompt_key, self.chosen_key, self.rejected_key,
                                 margin_key=MARGIN_COLUMN if self.margin_loss else None,
                                 apply_chat_template=self.apply_chat_template)
