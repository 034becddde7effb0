"""The environment of a Ray head we start (the embedded head, a stage's private cluster): it wastes no CPU on work
nobody uses. No idle workers are started ahead (every process of a stage has a runtime env they lack, so the two
prestarted per driver were thrown away), and the log monitor looks for new log files twice a second instead of ten
times (Ray's own back-off past 1,000 files: its glob of the logs folder grows with every worker the head has had).
A module of its own: stage jobs import it without the orchestration's settings."""

QUIET_HEAD_ENV = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0",
                  "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}
