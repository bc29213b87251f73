"""What a run reports: metrics files and TensorBoard, the progress bar, throughput and MFU, the summary.

metrics.py     metrics.jsonl and TensorBoard, the loss curve, the progress bar, the summary table
throughput.py  real units per second and the share of peak FLOP/s
peaks.py       peak FLOP/s per device: a chip table, or a measured matmul on CPU
summary.py     the end of a run: summary.json, the loss curve, the task's report
"""
