"""Stage entrypoints without ML, following the stage contract, for the orchestration tests."""
