import os
import sys

# Spawned worker processes import the test modules by name: make this folder importable.
sys.path.insert(0, os.path.dirname(__file__))
