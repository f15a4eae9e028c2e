import os
import sys

# Multi-process tests on a 2-core machine: one thread per process, or they oversubscribe and crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
