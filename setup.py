"""megatron-grpo: GRPO on Megatron-core models with an SGLang (or embedded) rollout engine."""

from setuptools import find_packages, setup

setup(
    name="megatron-grpo",
    version="0.1.0",
    description="Corrected GRPO on tensor/pipeline-parallel Megatron-core models with SGLang rollouts",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_grpo", "megatron_grpo.*"]),
    package_data={"megatron_grpo": ["py.typed"]},
    install_requires=[
        # torch is pinned loosely: on the CPU machines `pip install torch==2.13.0` first (see
        # README); GPU clusters bring their own CUDA build.
        "torch>=2.6",
        "megatron-core==0.16.1",
        "transformers>=4.56",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "pyyaml>=6",
        "numpy",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "httpx>=0.27",
        "pyarrow>=14",
        "matplotlib>=3.7",
        "tqdm",
        "psutil",  # megatron-core dist_checkpointing needs it
    ],
    extras_require={
        # GPU stack. apex has no usable PyPI wheel: build it from source per NVIDIA's notes.
        "gpu": ["transformer-engine[pytorch]"],
        "sglang": ["sglang>=0.5.23"],
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
        # reasoning-gym's tasks as data (tools/make_reasoning_gym_data.py) and the reasoning_gym and
        # math_verify rewards; imported only by the commands and reward workers that use them
        "reasoning": ["reasoning-gym>=0.1.25", "math-verify>=0.9.0"],
        # a GGUF file as an HF folder (tools/fetch_smollm2.py, models/gguf_import.py): transformers'
        # GGUF loader needs both
        "gguf": ["gguf>=0.10.0", "accelerate>=1.0"],
        # peft: loads an exported LoRA adapter onto the HF model (the export's independent check and
        # users' own inference); training LoRA needs nothing beyond the base install
        "lora": ["peft>=0.17"],
        # agents and the environment libraries (docs/agents.md, docs/multi_turn.md): the OpenAI SDK
        # (the agent worker's client), verifiers environments through their connector (0.4's
        # verifiers.v1 tasksets; the classic API of 0.1.14 to 0.3.x too), skyrl-gym and OpenEnv
        # environments (rollout.environment skyrl_gym:..., openenv:...). OpenEnv's module `openenv`
        # comes from openenv-core here: its other package, openenv 0.10, pins mcp < 2 (through
        # fastmcp < 4) and verifiers 0.4 pins mcp == 2.0.0, so the two cannot share an environment;
        # the `openenv` extra below installs it instead of verifiers. Imported only by the worker
        # processes of a run that names them; TRL-style tool classes (tools:...) need none of them.
        "agents": ["openai>=1.108.1", "verifiers>=0.1.14", "skyrl-gym>=0.4.0", "openenv-core>=0.3.0"],
        # OpenEnv's current package, for runs without verifiers 0.4 (the conflict above)
        "openenv": ["openenv>=0.10.0"],
        # tensorboard: its logging test; triton: the Triton kernels' tests (its CPU interpreter;
        # CUDA builds of torch bring triton, the CPU wheel does not); pytest-xdist: the suite runs on
        # two workers (launch/run_tests.sh). pytest < 9.1: xdist 3.8 groups tests by renaming their
        # node ids through ``item._nodeid``, which pytest 9.2 no longer reads (every group would be
        # split; tests/conftest.py refuses to run so)
        "test": ["pytest>=8,<9.1", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "tensorboard", "triton>=3.0"],
    },
    entry_points={"console_scripts": ["megatron-grpo=megatron_grpo.cli:run"]},
)
