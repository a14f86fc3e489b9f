"""The memory tool: Anthropic's ``memory_20250818`` file commands over the user's ledger rows.

The model sees a directory ``/memories``; each file is one row of ``memory`` (user, path,
content) and directories exist only as path prefixes. The commands edit the run's copy of
the user's files (``RunContext.memory``, in place); :meth:`MemoryFiles.writes` is the
difference from the state the run started with, which the worker's fenced finish applies.
A run that fails or goes stale therefore changes no memory.

Every refusal is a readable sentence returned to the model as an error result, never an
exception: a path outside ``/memories``, any ``..`` (the ledger's CHECK refuses it too, and
an agent write the finish cannot store would fail the whole run), a file over the size
limit, the user's total or file count over theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

from vigil.agent.base import MemoryWrite
from vigil.errors import VigilError

ROOT = "/memories"
TASKS_DIR = ROOT + "/tasks/"  # progress files of work that spans wake-ups (memory kind 4)
MAX_PATH_CHARS = 256
# Index lines: a title is the start of a file's first line, enough to decide whether to open it.
INDEX_TITLE_CHARS = 80
INDEX_MAX_FILES = 100


class MemoryRefused(VigilError):
    """A command the model sent that cannot be carried out; the message is for the model."""


@dataclass(frozen=True)
class Limits:
    file_bytes: int
    total_bytes: int
    max_files: int


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def confine(path: object, *, allow_root: bool = False) -> str:
    """The normalised path if it lies under /memories; raises MemoryRefused saying why not."""
    if not isinstance(path, str) or not path:
        raise MemoryRefused("A path is required, e.g. /memories/notes.md.")
    if len(path) > MAX_PATH_CHARS:
        raise MemoryRefused(f"The path is longer than {MAX_PATH_CHARS} characters.")
    if ".." in path:
        raise MemoryRefused(f"The path {path} contains '..': paths must stay inside {ROOT}.")
    if "\\" in path or any(ord(c) < 32 for c in path):
        raise MemoryRefused(f"The path {path!r} contains a backslash or a control character.")
    trimmed = path.rstrip("/") or "/"
    if trimmed == ROOT:
        if allow_root:
            return ROOT
        raise MemoryRefused(f"This command needs a file under {ROOT}, not {ROOT} itself.")
    if not trimmed.startswith(ROOT + "/"):
        raise MemoryRefused(f"The path {path} is outside {ROOT}: every memory path starts with {ROOT}/.")
    parts = trimmed[len(ROOT) + 1 :].split("/")
    if any(part in ("", ".") for part in parts):
        raise MemoryRefused(f"The path {path} has an empty or '.' component.")
    return trimmed


class MemoryFiles:
    """The user's memory files during one run; edits ``files`` in place."""

    def __init__(self, files: dict[str, str], limits: Limits):
        self.files = files
        self.limits = limits
        self._start = dict(files)

    # ---------------------------------------------------------------- run bookkeeping

    def checkpoint(self) -> dict[str, str]:
        return dict(self.files)

    def restore(self, checkpoint: dict[str, str]) -> None:
        """Back to ``checkpoint`` (an interrupted conversation's edits are dropped)."""
        self.files.clear()
        self.files.update(checkpoint)

    def writes(self) -> list[MemoryWrite]:
        """What the finish must store: changed or new files, then deleted ones, by path."""
        out = [MemoryWrite(p, c) for p, c in sorted(self.files.items()) if self._start.get(p) != c]
        out += [MemoryWrite(p, None) for p in sorted(self._start) if p not in self.files]
        return out

    # ---------------------------------------------------------------- the tool

    def execute(self, args: dict) -> str:
        """Run one memory command; raises MemoryRefused with a message for the model."""
        command = args.get("command")
        handler = {
            "view": self._view,
            "create": self._create,
            "str_replace": self._str_replace,
            "insert": self._insert,
            "delete": self._delete,
            "rename": self._rename,
        }.get(command if isinstance(command, str) else "")
        if handler is None:
            raise MemoryRefused(
                f"Unknown command {command!r}: use view, create, str_replace, insert, delete or rename."
            )
        return handler(args)

    def answer(self, args: dict) -> tuple[str, bool]:
        """:meth:`execute` as a tool result: the text for the model, and whether it is a refusal."""
        try:
            return self.execute(args), False
        except MemoryRefused as refused:
            return str(refused), True

    def _under(self, directory: str) -> list[str]:
        prefix = directory + "/"
        return sorted(p for p in self.files if p.startswith(prefix))

    def _file(self, path: str) -> str:
        if path not in self.files:
            if self._under(path):
                raise MemoryRefused(f"{path} is a directory; give a file path.")
            raise MemoryRefused(f"The path {path} does not exist.")
        return self.files[path]

    def _store(self, path: str, content: str) -> None:
        """Write ``content`` at ``path`` if every limit allows it."""
        size = _nbytes(content)
        if size > self.limits.file_bytes:
            raise MemoryRefused(
                f"{path} would be {size} bytes; the limit is {self.limits.file_bytes} bytes per file. "
                "Keep it shorter or split it into several files."
            )
        others = sum(_nbytes(c) for p, c in self.files.items() if p != path)
        if others + size > self.limits.total_bytes:
            raise MemoryRefused(
                f"Memory would hold {others + size} bytes; the limit is {self.limits.total_bytes}. "
                "Delete or shorten files you no longer need first."
            )
        if path not in self.files and len(self.files) >= self.limits.max_files:
            raise MemoryRefused(f"Memory already holds {len(self.files)} files, the limit. Delete or merge some first.")
        if any(p.startswith(path + "/") for p in self.files):
            raise MemoryRefused(f"{path} is a directory.")
        parent = path
        while (parent := parent.rsplit("/", 1)[0]) != ROOT:
            if parent in self.files:
                raise MemoryRefused(f"{parent} is a file, so it cannot hold {path}.")
        self.files[path] = content

    def _view(self, args: dict) -> str:
        path = confine(args.get("path"), allow_root=True)
        if path == ROOT or path not in self.files:
            entries = self._under(path)
            if not entries and path != ROOT:
                raise MemoryRefused(f"The path {path} does not exist.")
            lines = [f"{_nbytes(self.files[p])}\t{p}" for p in entries]
            return f"Files under {path} (bytes, path):\n" + ("\n".join(lines) if lines else "(empty)")
        lines = self.files[path].split("\n")
        first, last = 1, len(lines)
        view_range = args.get("view_range")
        if view_range is not None:
            if (
                not isinstance(view_range, list)
                or len(view_range) != 2
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in view_range)
            ):
                raise MemoryRefused("view_range is [first_line, last_line], with -1 for the end.")
            first, last = view_range[0], (len(lines) if view_range[1] == -1 else view_range[1])
            if not 1 <= first <= len(lines) or last < first:
                raise MemoryRefused(f"view_range {view_range} is outside the file's {len(lines)} lines.")
        numbered = [f"{n:6d}\t{lines[n - 1]}" for n in range(first, min(last, len(lines)) + 1)]
        return f"Here's the content of {path} with line numbers:\n" + "\n".join(numbered)

    def _create(self, args: dict) -> str:
        path = confine(args.get("path"))
        text = args.get("file_text")
        if not isinstance(text, str):
            raise MemoryRefused("create needs file_text.")
        if path in self.files:
            raise MemoryRefused(f"File {path} already exists: edit it with str_replace or insert, or delete it first.")
        self._store(path, text)
        return f"File created successfully at: {path}"

    def _str_replace(self, args: dict) -> str:
        path = confine(args.get("path"))
        old, new = args.get("old_str"), args.get("new_str")
        if not isinstance(old, str) or not old or not isinstance(new, str):
            raise MemoryRefused("str_replace needs a non-empty old_str and a new_str.")
        content = self._file(path)
        count = content.count(old)
        if count == 0:
            raise MemoryRefused(f"No replacement was performed: old_str does not appear verbatim in {path}.")
        if count > 1:
            raise MemoryRefused(
                f"No replacement was performed: old_str appears {count} times in {path}; make it unique."
            )
        self._store(path, content.replace(old, new, 1))
        return f"The memory file {path} has been edited."

    def _insert(self, args: dict) -> str:
        path = confine(args.get("path"))
        line, text = args.get("insert_line"), args.get("insert_text")
        if not isinstance(line, int) or isinstance(line, bool) or not isinstance(text, str):
            raise MemoryRefused("insert needs an integer insert_line and an insert_text.")
        lines = self._file(path).split("\n")
        if not 0 <= line <= len(lines):
            raise MemoryRefused(f"insert_line {line} is outside [0, {len(lines)}] for {path}.")
        self._store(path, "\n".join(lines[:line] + text.split("\n") + lines[line:]))
        return f"The file {path} has been edited."

    def _delete(self, args: dict) -> str:
        path = confine(args.get("path"))
        if path in self.files:
            del self.files[path]
            return f"Successfully deleted {path}"
        entries = self._under(path)
        if not entries:
            raise MemoryRefused(f"The path {path} does not exist.")
        for p in entries:
            del self.files[p]
        return f"Successfully deleted {path} ({len(entries)} files)"

    def _rename(self, args: dict) -> str:
        old, new = confine(args.get("old_path")), confine(args.get("new_path"))
        if new == old or new.startswith(old + "/"):
            raise MemoryRefused(f"Cannot move {old} into itself.")
        if new in self.files or self._under(new):
            raise MemoryRefused(f"The destination {new} already exists.")
        moves = {old: new} if old in self.files else {p: new + p[len(old) :] for p in self._under(old)}
        if not moves:
            raise MemoryRefused(f"The path {old} does not exist.")
        taken = {p: c for p, c in self.files.items() if p not in moves}
        for _source, target in moves.items():
            confine(target)  # a long old prefix can push the new path past the length limit
            if any(p.startswith(target + "/") or target.startswith(p + "/") for p in taken):
                raise MemoryRefused(f"{target} would collide with an existing file or directory.")
        contents = {target: self.files.pop(source) for source, target in moves.items()}
        self.files.update(contents)
        return f"Successfully renamed {old} to {new}"

    # ---------------------------------------------------------------- the prompt's view

    def index(self, instructions_path: str) -> str:
        """The memory index for the cached prefix: one line per file with its title.

        Only paths and first lines: a note's body changing does not move the cached prefix,
        only a new, deleted or retitled file does.
        """
        lines = []
        # Task progress files first (work spanning wake-ups, to be continued), so that a long
        # index never cuts them off; then the notes.
        ordered = sorted(self.files, key=lambda p: (not p.startswith(TASKS_DIR), p))
        for path in ordered[:INDEX_MAX_FILES]:
            if path == instructions_path:
                continue
            first = self.files[path].lstrip().split("\n", 1)[0].strip().lstrip("#").strip()
            title = first[:INDEX_TITLE_CHARS] + ("..." if len(first) > INDEX_TITLE_CHARS else "")
            task = "task in progress: " if path.startswith(TASKS_DIR) else ""
            lines.append(f"- {task}{path}" + (f" -- {title}" if title else ""))
        if len(self.files) > INDEX_MAX_FILES:
            lines.append(f"- ... and {len(self.files) - INDEX_MAX_FILES} more: view {ROOT} for all")
        return "\n".join(lines) if lines else "(no files yet)"
