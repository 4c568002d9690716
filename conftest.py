# Loads the project's pytest plugin where the packages are on PYTHONPATH but not installed (the GPU
# machine); installed packages load it through tk-core's pytest11 entry point under the same name.
pytest_plugins = ["tk_core.testing.plugin"]
