"""What the control plane (`kvloom.cluster`) and the data plane (`kvloom.workers`) share.

The types both planes exchange live here, and nowhere else: the engine configuration the
workers are built from, sampling parameters, each step's SchedulerOutput and the workers'
ModelRunnerOutput, the KV-cache specs workers report and the plan the control plane
makes from them, and the step channel that carries steps and results with its codecs.
Besides them, one process convention both planes' long-lived processes follow
(`gc_freeze`).

The data plane imports nothing of `kvloom.cluster`, only these; this package imports
neither plane, nor torch (tests/test_layering.py checks both).
"""
