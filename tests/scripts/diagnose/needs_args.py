"""A script with a required argument, run without it."""
import argparse

p = argparse.ArgumentParser()
p.add_argument("--data", required=True)
args = p.parse_args()
