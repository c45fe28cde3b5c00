"""`python -m asyncrl.orchestrator RUN_DIR`: the orchestrator role (asyncrl/orchestrator/main.py).

Nothing is imported at module level. The verifier pool's workers are forked by multiprocessing's fork
server, and each child imports the parent's main module again unless it is a package's `__main__`: with
`python -m asyncrl.orchestrator.main` every worker imported the orchestrator and all it imports (2.4 s
of CPU each), which held the first batch's scores back by ~3.4 s of a 30 s run.
"""
if __name__ == "__main__":
    import sys
    from pathlib import Path

    from asyncrl.orchestrator.main import main
    from asyncrl.run import event_loop
    from asyncrl.run.role import run_role

    run_role("orchestrator", sys.argv[1], lambda: event_loop.run(main(Path(sys.argv[1]))))
