"""Benchmark programs (run as scripts: ``python benchmarks/<program>.py``). A regular package, so
that ``benchmarks.*`` imports from the repository (the tests') find these modules and not the
top-level ``benchmarks`` package that google-jetstream's wheel also installs: a regular package
anywhere on the path wins over a namespace package."""
