"""The cost model: GPU database, per-node roofline step model, acceptance model, gap ranking,
calibration from benchmark results. See docs/COST-MODEL.md."""

from .acceptance import AcceptanceModel, alpha_for_tau, tau_for_alpha
from .gaps import Gap, pipeline_string
from .gpu import GPU, gpu_aliases, gpu_names, load_gpu, resolve_gpu
from .model import (
    AcceptanceRecord, Ceiling, CostModel, Estimate, Figure, SpecStep, StepRecord, Workload, calibration_files, explain,
    parse_records, shape_name,
)
from .report import plot_gaps, render_table
from .roofline import NodeCost, StepEstimate, matmul_weight_bytes, step_time, weight_footprint

__all__ = [
    "AcceptanceModel", "AcceptanceRecord", "Ceiling", "CostModel", "Estimate", "Figure", "GPU", "Gap", "NodeCost",
    "SpecStep", "StepEstimate", "StepRecord", "Workload", "alpha_for_tau", "calibration_files", "explain", "gpu_aliases", "gpu_names",
    "load_gpu", "matmul_weight_bytes", "parse_records", "pipeline_string", "render_table", "plot_gaps",
    "resolve_gpu", "shape_name", "step_time", "tau_for_alpha", "weight_footprint",
]
