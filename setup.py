"""Install with `pip install .` (a regular install: the .pth auto-activation hook is copied into
site-packages; an editable install does not carry it, see README)."""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py as _build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PTH = "deepspeed_async_ckpt.pth"


class build_py(_build_py):
    """Also place the .pth file at the root of the wheel, so it lands in site-packages."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))


setup(
    name="deepspeed-async-ckpt",
    version="0.1.0",
    description="Asynchronous, lazy, rank-aware checkpointing for DeepSpeed and Megatron-core",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    py_modules=["deepspeed_async_ckpt_autoload"],
    packages=find_packages(include=["deepspeed_async_ckpt", "deepspeed_async_ckpt.*",
                                    "megatron_adapter", "megatron_adapter.*"]),
    install_requires=["torch>=2.7", "deepspeed>=0.17", "nvidia-ml-py", "xxhash>=3.0"],
    extras_require={
        "megatron": ["megatron-core>=0.16,<0.17"],
        "hf": ["transformers>=5,<6", "accelerate>=1.0"],
        "s3": ["boto3>=1.34"],
        "test": ["pytest>=8", "pytest-timeout", "megatron-core>=0.16,<0.17", "matplotlib", "tensorboard",
                 "transformers>=5,<6", "accelerate>=1.0", "boto3>=1.34", "moto[server]>=5"],
    },
    entry_points={"console_scripts": ["ds-async-ckpt=deepspeed_async_ckpt.tools.cli:main"]},
    cmdclass={"build_py": build_py},
)
