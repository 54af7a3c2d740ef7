from setuptools import setup

# Metadata and dependencies live in setup.cfg; this file only exists for tools that need it.
setup()
