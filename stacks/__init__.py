"""The CDK app: ImageStack (shared build), CpuStack and GpuStack (SageMaker endpoints).

`stacks.config` (no aws_cdk import) validates the configuration; `stacks.assembly.build_app`
creates the stacks; `stacks.synth.synthesize` synthesizes them in-process for tools and tests.
"""
