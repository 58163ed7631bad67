"""What the subcommands share, in one place to import from: exit codes
(:mod:`~gradaccum.cli.exitcodes`), the console, tables and findings (:mod:`~gradaccum.cli.console`),
argument types and shared options (:mod:`~gradaccum.cli.options`), and memory checks and the launcher
(:mod:`~gradaccum.cli.launching`). Nothing imported here loads torch, so ``gradaccum --help``,
``gradaccum CMD --help`` and ``gradaccum plan`` start without importing torch.
"""

from __future__ import annotations

from gradaccum.cli.console import (
    console,
    escape,
    group_findings,
    mark,
    progress_bar,
    render_findings,
    rich_table,
    yes_no,
)
from gradaccum.cli.exitcodes import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INCONCLUSIVE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
)
from gradaccum.cli.launching import (
    Launching,
    available_memory_bytes,
    finish_launching,
    make_launching,
    refuse_what_cannot_fit,
    resolve_device,
    resolve_dp,
    torchrun_leader,
    torchrun_world,
)
from gradaccum.cli.options import (
    add_data_options,
    add_measure_options,
    add_threads_option,
    add_workload_option,
    check_output_folder,
    default_threads,
    int_at_least,
    measure_settings,
    mesh_under_torchrun,
    number_above,
    output_folder,
    parse_plan,
    parse_size,
    workload_spec,
)
from gradaccum.names import DEFAULT_WORKLOAD

__all__ = [
    "DEFAULT_WORKLOAD",
    "EXIT_BAD_INPUT",
    "EXIT_FAILED",
    "EXIT_INCONCLUSIVE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "Launching",
    "add_data_options",
    "add_measure_options",
    "add_threads_option",
    "add_workload_option",
    "available_memory_bytes",
    "check_output_folder",
    "console",
    "default_threads",
    "escape",
    "finish_launching",
    "group_findings",
    "int_at_least",
    "make_launching",
    "mark",
    "measure_settings",
    "mesh_under_torchrun",
    "number_above",
    "output_folder",
    "parse_plan",
    "parse_size",
    "progress_bar",
    "refuse_what_cannot_fit",
    "render_findings",
    "resolve_device",
    "resolve_dp",
    "rich_table",
    "torchrun_leader",
    "torchrun_world",
    "workload_spec",
    "yes_no",
]
