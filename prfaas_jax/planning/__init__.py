"""Planning: the plan config (`plan_config`), prefill hardware and its T_prefill profiles
(`hardware`), prefill FLOPs (`prefill_cost`), and what `prfaas plan` and `prfaas kv` print
(`plan_report`, `kv_report`, and `kv_vs_paper` against the paper's `paper_tables`). The
discrete-event simulator that replays a plan under bursts, caches and bandwidth drops is
`prfaas_jax/sim/`."""
