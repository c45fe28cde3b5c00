"""Starting a run's roles and keeping them alive.

launcher      `asyncrl train`: checks, starts the roles, waits for the end, writes the report
supervisor    the local role processes: restart, heartbeats, deadlines, no orphans
processes     spawning one role process (its command, environment and log)
preflight     every input checked before any role starts
sizes         every size checked against what it must fit (context, queue, memory)
memory        whether a role died of memory (peak RSS, the kernel's OOM kills)
resume_check  what a resumed run must agree with
lock          one launcher per run directory
starter       one process that imports the roles' code once and forks each role
threads       how many torch threads each role gets on this machine
chaos         role kills on a schedule, for the recovery tests and benchmarks
role          a role process's entry: logging, the fatal-error contract
heartbeat, ports, event_loop   what every role process shares
"""
