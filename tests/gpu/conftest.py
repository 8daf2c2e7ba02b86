import os
import sys

# tests/reference.py (the float64 references) lives one level up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
