"""Maps the top-level folders under the one import root `kvloom` (see ARCHITECTURE §1)."""

from setuptools import find_packages, setup

ROOTS = {
    "kvloom": "kvloom",
    "kvloom.contracts": "contracts",
    "kvloom.cluster": "cluster",
    "kvloom.workers": "workers",
    "kvloom.kernels": "kernels",
    "kvloom.protos": "protos",
}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    packages.append(name)
    package_dir[name] = folder
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
