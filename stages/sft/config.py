"""The SFT stage's config: its flags, their defaults and the combinations it refuses."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from stages.config import (
    BaseModelPath, OfflineTrainingConfig, OutputPath, RouterBalancing, SupervisedKeys, ckpt_path_field,
    learning_rate_field, max_epochs_field,
)
from stages.fields import RUN_OVERRIDE


class SFTConfig(SupervisedKeys, RouterBalancing, OfflineTrainingConfig):
    """Supervised fine-tuning: `python -m stages.sft`."""

    stage = "sft"
    tiny_rows = "sft"
    tiny_assets = {"pretrain": "model", "dataset": "sft_train", "eval_dataset": "sft_eval"}

    pretrain: BaseModelPath = Field(None, description="model to fine-tune (HF dir, hub name or s3:// URI)")
    ckpt_path: OutputPath = ckpt_path_field("./ckpt/checkpoints_sft")
    learning_rate: float = learning_rate_field(5e-6)
    max_epochs: Annotated[int, RUN_OVERRIDE] = max_epochs_field(2)
    system_key: str | None = Field(
        None,
        description="dataset column holding a system prompt (OpenOrca's system_prompt), rendered as a system message "
        "before the prompt; empty values add none",
    )
    multiturn: bool = Field(
        False,
        description="--input_key holds whole conversations (lists of messages): loss on every assistant turn",
    )
    pretrain_mode: bool = Field(
        False, description="continued pre-training: loss on every token of the --input_key text, no response column",
    )

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.multiturn and self.pretrain_mode:
            problems.append("--multiturn and --pretrain_mode exclude each other: pick one loss mask")
        if self.multiturn and not self.apply_chat_template:
            problems.append("--multiturn needs --apply_chat_template (conversations are rendered by the chat template)")
        if self.system_key is not None:
            if self.multiturn or self.pretrain_mode:
                problems.append("--system_key applies to prompt/response rows: a conversation holds its own system "
                                "message, and --pretrain_mode has no prompt")
            elif not self.apply_chat_template:
                problems.append("--system_key needs --apply_chat_template (a system prompt is a chat message)")
        return problems

    def validate_rows(self, rows, source: str) -> None:
        """The schema check of the rows this stage trains on (the stage's and the plan's): exit 2 naming the row."""
        from stages import data

        data.validate_sft(rows, source, self.input_key, self.output_key, multiturn=self.multiturn,
                          pretrain_mode=self.pretrain_mode, system_key=self.system_key,
                          apply_chat_template=self.apply_chat_template)
