"""The ``ds-async-ckpt`` command-line tools, apart from the engine they inspect.

- :mod:`.cli`: the parser and ``main`` (the console entry point);
- :mod:`.list_cmd`, :mod:`.verify_cmd`: what a save directory holds, and whether a checkpoint's
  bytes match its manifest; :mod:`.save_dir` is how both read a save directory;
- :mod:`.plan_cmd`, :mod:`.plan_report`: the ``plan`` subcommand, its inputs and its report;
- :mod:`.capacity` (the plan), :mod:`.plan_inputs` (validated inputs), :mod:`.formulas`: the
  capacity planner, pure standard-library math.

Importing the planner loads no torch; ``list`` and ``verify`` load the engine's commit module
when they run.
"""
