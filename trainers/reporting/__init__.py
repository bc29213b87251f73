"""What a run reports: metrics files and TensorBoard, the console, throughput and MFU, the summary.

metrics.py      metrics.jsonl and TensorBoard events, read back
loss_curve.py   the loss curve as a PNG
console.py      the progress bar and the summary table, on process 0
throughput.py   real units per second and the share of peak FLOP/s
peaks.py        a device's peak FLOP/s: from the chip table, or measured
chips.py        the chips the harness knows: peak FLOP/s and memory per device kind
matmul_peak.py  the FLOP/s of a large matmul, measured (a CPU's peak)
summary.py      the end of a run: summary.json, the loss curve, the task's report
tracking.py     Weights & Biases: the metrics records and the summary (optional)
"""
