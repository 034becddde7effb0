"""The pipeline's logic as plain functions: shapes and wiring, stage identity, the plan, the gate, the rehearsal.

Nothing here imports Prefect: tasks/ wraps these functions as Prefect tasks and flows/ chains them. Below it are
stages/ (what the stage jobs run) and infra/ (artifact store, Ray, settings), never above.
"""
