from setuptools import find_packages, setup

setup(
    name="yarnapp",
    version="0.1.0",
    description="Train convolutional networks across the mixed CPUs and GPUs of a YARN cluster",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["conf", "yarnapp", "yarnapp.*", "launcher", "launcher.*",
                                    "training", "training.*"]),
    package_data={"conf": ["defaults.yaml", "examples/*.yaml", "constraints.txt",
                            "hadoop/pom.xml", "hadoop/etc/*"]},
    install_requires=[
        "pydantic>=2.5",
        "pyyaml>=6",
        "numpy>=1.24",
        "torch>=2.1",
        "mpi4py>=4.0",
        # MPICH 5.0.x cannot join singleton worlds (pmodels/mpich#7805); 4.3 can.
        "mpich>=4.3,<5",
        "pyarrow>=14",
        "tensorboard>=2.14",
        "skein>=0.8.2",
        "venv-pack>=0.2",
        "scikit-learn>=1.3",   # ships the digits data set used by the examples
        "Pillow>=9.1",         # decodes and resizes images (training.data)
        "simplejpeg>=1.6",     # decodes JPEG several times faster than Pillow for small images
        "tqdm>=4.60",
        "psutil>=5.9",
        "requests>=2.25",      # fsspec's WebHDFS (webhdfs:// data and checkpoints) needs it; torch brings fsspec
        "cloudpickle>=2.2",    # ships a function from a notebook (yarnapp.submit(job, function=f))
        "setuptools>=61",      # find_packages: the top-level packages of editable installs to ship
        "matplotlib>=3.7",
        "mtkahypar>=1.7",      # hypergraph partitioner of the hypergraph strategy
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3.8", "nbclient>=0.9", "nbformat>=5.9", "ipykernel>=6"],
    },
    entry_points={"console_scripts": ["yarnapp=yarnapp.cli:main"]},
)
