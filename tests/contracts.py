"""A custom import-linter contract: only the named seams may import a library's internals.

import-linter's built-in ``forbidden`` contract cannot name a subpackage of an external
package (the graph squashes ``transformers.generation…`` into ``transformers``), so this
contract reads each direct import's line from the graph's import details instead.
Configured in ``pyproject.toml`` as ``type = "seam"``.
"""

from __future__ import annotations

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output


class SeamContract(Contract):
    """Modules under ``source_modules`` import ``internals`` only from the ``seams``."""

    source_modules = fields.ListField(subfield=fields.StringField())
    seams = fields.ListField(subfield=fields.StringField())
    package = fields.StringField()
    internals = fields.ListField(subfield=fields.StringField())

    def _is_seam(self, module: str) -> bool:
        return any(module == s or module.startswith(s + ".") for s in self.seams)

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        wanted = tuple(f"{self.package}.{name}" for name in self.internals)
        offences = []
        for source in self.source_modules:
            for module in sorted({source} | graph.find_descendants(source)):
                if self._is_seam(module):
                    continue
                if self.package not in graph.find_modules_directly_imported_by(module):
                    continue
                for detail in graph.get_import_details(importer=module, imported=self.package):
                    line = detail["line_contents"]
                    if any(w in line for w in wanted):
                        offences.append(f"{module}:{detail['line_number']}: {line}")
        return ContractCheck(kept=not offences, metadata={"offences": offences})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for offence in check.metadata["offences"]:
            output.print_error(f"- {offence}")
