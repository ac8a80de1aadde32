"""Shared pytest setup: every test process and every rank it starts uses one thread."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
