"""Session reports: the data model (`model`), JSON and CSV files (`files`), HTML and PDF (`render`, Qt).

The Qt-free parts are re-exported here; `app.report.render` is imported only where Qt is wanted.
"""

from .files import (
    ReportWriteError,
    atomic_write,
    atomic_write_many,
    check_target,
    csv_paths,
    load_report,
    read_csv,
    report_from_dict,
    report_to_dict,
    report_to_json,
    requests_csv,
    timeline_csv,
    write_bytes,
    write_csv,
    write_json,
)
from .model import (
    SCHEMA,
    MachineInfo,
    ModelInfo,
    PageMapState,
    Report,
    ReportSettings,
    Totals,
    build_report,
    file_sha256,
    snapshot_from_report,
)

__all__ = [
    "SCHEMA", "MachineInfo", "ModelInfo", "PageMapState", "Report", "ReportSettings", "ReportWriteError",
    "Totals", "atomic_write", "atomic_write_many", "build_report", "check_target", "csv_paths",
    "file_sha256", "load_report", "read_csv", "report_from_dict", "report_to_dict", "report_to_json",
    "requests_csv", "snapshot_from_report", "timeline_csv", "write_bytes", "write_csv",
    "write_json",
]
