"""The KTO stage's config: its flags, their defaults and the combinations it refuses."""

from __future__ import annotations

from pydantic import Field

from stages.config import (
    OfflineTrainingConfig, OutputPath, PolicyPath, PreferenceKeys, SupervisedKeys, ckpt_path_field,
    learning_rate_field,
)


class KTOConfig(SupervisedKeys, PreferenceKeys, OfflineTrainingConfig):
    """Kahneman-Tversky optimisation on unpaired desirable/undesirable responses: `python -m stages.kto`.

    Rows are unpaired (--input_key, --output_key, --label_key) or, when the dataset has --chosen_key and
    --rejected_key columns, preference pairs that are split into one desirable and one undesirable row each.
    """

    stage = "kto"
    trains_policy = True
    tiny_rows = "kto"
    tiny_assets = {"pretrain": "model", "dataset": "kto_train", "eval_dataset": "kto_eval"}

    pretrain: PolicyPath = Field(None, description="policy to train, usually the SFT model")
    ref_pretrain: PolicyPath = Field(None, description="frozen reference model; unset: a copy of --pretrain")
    ckpt_path: OutputPath = ckpt_path_field("./ckpt/checkpoints_kto")
    learning_rate: float = learning_rate_field(1e-5)
    label_key: str = Field("label", description="dataset column saying whether the response is desirable (bool)")
    beta: float = Field(0.01, gt=0, description="strength of the implicit KL constraint to the reference")
    desirable_loss_weight: float = Field(1.0, gt=0, description="loss weight of desirable samples")
    undesirable_loss_weight: float = Field(1.0, gt=0, description="loss weight of undesirable samples")

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.micro_train_batch_size < 2:
            problems.append(
                "--micro_train_batch_size 1: KTO's KL reference point scores each prompt with another sample's "
                "response from the same micro-batch, so it needs at least 2"
            )
        return problems

    def is_paired(self, rows) -> bool:
        """Preference pairs (to split) rather than unpaired rows: the dataset has both pair columns."""
        return self.chosen_key in rows.column_names and self.rejected_key in rows.column_names

    def validate_rows(self, rows, source: str) -> None:
        """The schema check of the rows this stage trains on (the stage's and the plan's): exit 2 naming the row."""
        from stages import data

        if self.is_paired(rows):
            data.validate_preference(rows, source, self.prompt_key, self.chosen_key, self.rejected_key,
                                     apply_chat_template=self.apply_chat_template)
        else:
            data.validate_kto(rows, source, self.input_key, self.output_key, self.label_key,
                              apply_chat_template=self.apply_chat_template)
