"""Steering a running job: who may (access: the run's token), the control API (api) and its client
(ctl), settings changed live (live), pausing (pausing)."""
