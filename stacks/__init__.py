"""The CDK app: ImageStack (shared build), CpuStack and GpuStack (SageMaker endpoints).

`decider_stacks.config` (no aws_cdk import) validates the configuration; `decider_stacks.assembly.build_app`
creates the stacks; `decider_stacks.synth.synthesize` synthesizes them in-process for tools and tests.
"""
