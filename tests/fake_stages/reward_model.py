"""Toy reward_model stage (tests/fake_stages/pipeline_toy.py)."""

from tests.fake_stages.pipeline_toy import main

if __name__ == "__main__":
    main("reward_model")
