"""The ranks of the tests' MPI worlds: real modules run with `python -m ranks.NAME ARGS_JSON`
on n processes that join one world as an application's containers join
(training.probes.run, launcher.world.spawn_local / join_local). Each builds its
RunContext with RunContext.offline over a conf.offline_job, as the planner's probes and
the benchmarks do, runs the checks its arguments name, and rank 0 reports what the
tests assert (tests/worlds.py starts them)."""
