"""Replaced by the study command, which adds the seeds' spread and judges the claims:

    normlab-study output_change        # writes experiments/output_change/

Kept so the commands in this folder's README still run.
"""
import sys

from normlab.commands.study import main

if __name__ == "__main__":
    sys.exit(main(["output_change", *sys.argv[1:]]))
