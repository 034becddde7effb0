"""Check every dataset of a pipeline with the stages' pandera schemas before any Ray job starts."""

from __future__ import annotations

from prefect import get_run_logger, task

from stages.config import PipelineConfig


@task(name="validate-data", persist_result=True)
def validate_data(config: PipelineConfig) -> list[str]:
    """Load each dataset the stages will read (same rows) and validate it; raises DataValidationError naming
    the file, the failed checks and the rows. Returns the sources checked."""
    from stages import data

    logger = get_run_logger()
    sft, rm, rl, evaluate = config.sft, config.reward_model, config.rl, config.evaluate
    checks = [
        *[(source, sft.max_samples, lambda rows, s: data.validate_sft(rows, s, sft.input_key, sft.output_key))
          for source in (sft.dataset, sft.eval_dataset)],
        *[(source, rm.max_samples,
           lambda rows, s: data.validate_preference(rows, s, rm.prompt_key, rm.chosen_key, rm.rejected_key))
          for source in (rm.dataset, rm.eval_dataset)],
        (rl.prompt_data, rl.max_samples, lambda rows, s: data.validate_prompts(rows, s, rl.input_key, rl.label_key)),
        (evaluate.prompt_data, evaluate.max_samples,
         lambda rows, s: data.validate_prompts(rows, s, evaluate.input_key, evaluate.label_key)),
    ]  # fmt: skip
    checked = []
    for source, max_samples, validate in checks:
        if source is None:
            continue
        rows = data.load_rows(source, max_samples=max_samples)
        validate(rows, source)
        logger.info(f"validated {source}: {len(rows)} rows")
        checked.append(source)
    return checked
