"""A document's text, for the vector stores: what ``document_text`` makes of an uploaded file.

Each kind is read by the library made for it, and told apart by its bytes (the name only for
HTML, which is text either way):

* **PDF** (pypdf): each page's text, pages apart by a blank line.
* **Word** ``.docx`` (python-docx): the body's paragraphs and tables in document order; a heading
  as Markdown's ``#`` (by its level), a table a row per line, cells apart by `` | ``.
* **PowerPoint** ``.pptx`` (python-pptx): per slide, ``## Slide N``, then each shape's text (its
  paragraphs, a table's rows as Word's, a group's shapes) and the speaker notes.
* **HTML** (Beautiful Soup, its ``html.parser``; a ``.html``/``.htm``/``.xhtml`` name, or text that
  opens with ``<!doctype html`` or ``<html``): the text a reader sees, in its encoding (a
  ``<meta charset>`` is honoured): no markup, scripts or styles; block elements begin lines,
  headings are ``#`` lines and list items ``- `` lines.
* Anything else that is **UTF-8** (Markdown, code, JSON, plain text) as it is, less a byte-order mark.

``Unreadable`` (with OpenAI's ``last_error.code``: ``unsupported_file`` or ``invalid_file``) for
the rest: encrypted or broken PDFs and Office files, other Office formats (``.xlsx``, ``.odt``,
the old binary ``.doc``/``.ppt``), images, archives. An Office file is a ZIP of XML parts: its
parts may unpack to at most ``MAX_UNPACKED`` bytes, its XML parts to ``MAX_XML`` (parsed into a
tree of ~35 bytes of memory per byte of XML: 256 MiB of it took ~9 GB and ~10 minutes), checked
from the archive's directory before any part but ``[Content_Types].xml`` is read, so a small upload
cannot expand into gigabytes (a part is XML by its name, or by the content type that part gives it,
which is what the libraries go by: a part named ``.dat`` may be the document's XML); both libraries
parse with lxml without resolving entities. A PDF's text stops at
``MAX_TEXT_CHARS`` (``invalid_file``), checked after each page: pages may share one content
stream, so a small PDF can hold its text many times over. An HTML page may hold at most
``MAX_HTML_TAGS`` tags (its ``<`` counted before it is parsed: each element costs ~20 us of CPU
and ~1 KiB of memory in Beautiful Soup, so a 25 MiB page of empty elements took ~40 s and ~2 GB).
"""

from __future__ import annotations

import io
import re
import zipfile

import pypdf
from pypdf.errors import PdfReadError

MAX_UNPACKED = 256 * 2**20  # what an Office file's parts may unpack to, together
MAX_XML = 32 * 2**20  # and its XML parts (a 500-page document's is a few MiB)
MAX_TEXT_CHARS = 40_000_000  # a PDF's text (a vector store reads at most 5,000,000 tokens of a file)
MAX_HTML_TAGS = 400_000  # an HTML page's '<' (a long encyclopedia article has ~100,000): ~4 s and ~300 MiB to parse
HTML_NAMES = (".html", ".htm", ".xhtml")
_HTML_START = re.compile(rb"\s*(<!--.*?-->\s*)*<(!doctype\s+html|html[\s>])", re.IGNORECASE | re.DOTALL)
_OLE = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"  # the old binary Office formats' signature


class Unreadable(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def document_text(content: bytes, filename: str = "") -> str:
    """The text of an uploaded document (see the module's docstring); ``Unreadable`` if none."""
    if content.startswith(b"%PDF-"):
        return _pdf(content)
    if content.startswith(b"PK\x03\x04"):
        return _office(content)
    if content.startswith(_OLE):
        raise Unreadable("unsupported_file", "old binary Office files (.doc, .ppt, .xls) are not read; "
                                             "save the document as .docx or .pptx")
    if filename.lower().endswith(HTML_NAMES) or _HTML_START.match(content.removeprefix(b"\xef\xbb\xbf")[:4096]):
        return _html(content)
    try:
        return content.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        raise Unreadable("unsupported_file", "the file is not a PDF, a Word or PowerPoint file, HTML or UTF-8 text "
                                             "(Markdown, code, JSON)") from None


def _pdf(content: bytes) -> str:
    try:
        reader = pypdf.PdfReader(io.BytesIO(content))
        encrypted = reader.is_encrypted
        text = "" if encrypted else "\n\n".join(_pages(reader))
    except PdfReadError as exc:
        raise Unreadable("invalid_file", f"the PDF cannot be read: {exc}") from None
    except Unreadable:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed PDF trips pypdf in many ways: the file's fault
        raise Unreadable("invalid_file", f"the PDF cannot be read ({type(exc).__name__})") from None
    if encrypted:
        raise Unreadable("unsupported_file", "the PDF is encrypted")
    return text


def _pages(reader: pypdf.PdfReader) -> list[str]:
    """Each page's text, until they hold more than ``MAX_TEXT_CHARS`` (``Unreadable``)."""
    pages, total = [], 0
    for page in reader.pages:
        pages.append(page.extract_text())
        total += len(pages[-1])
        if total > MAX_TEXT_CHARS:
            raise Unreadable("invalid_file", f"the PDF's text is longer than {MAX_TEXT_CHARS:,} characters")
    return pages


def _office(content: bytes) -> str:
    """A Word or PowerPoint file's text; other ZIPs are refused before any part is unpacked."""
    try:
        with zipfile.ZipFile(io.BytesIO(content)) as archive:
            parts = archive.infolist()
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise Unreadable("invalid_file", f"the file looks like an Office file or a ZIP but cannot be opened: {exc}") from None
    names = {part.filename for part in parts}
    if "word/document.xml" in names:
        kind, read = "Word", _docx
    elif "ppt/presentation.xml" in names:
        kind, read = "PowerPoint", _pptx
    else:
        what = ("an Excel workbook" if "xl/workbook.xml" in names else
                "an OpenDocument file" if "mimetype" in names else "a ZIP archive")
        raise Unreadable("unsupported_file", f"the file is {what}; of Office files only Word (.docx) and "
                                             "PowerPoint (.pptx) are read")
    if sum(part.file_size for part in parts) > MAX_UNPACKED:
        raise Unreadable("invalid_file", f"the {kind} file unpacks to more than {MAX_UNPACKED // 2**20} MiB")
    xml_named = [part for part in parts if part.filename.lower().endswith((".xml", ".rels"))]
    if sum(part.file_size for part in xml_named) > MAX_XML:  # [Content_Types].xml among them: read next
        raise Unreadable("invalid_file", f"the {kind} file's XML unpacks to more than {MAX_XML // 2**20} MiB")
    if sum(part.file_size for part in _xml_typed(content, parts)) > MAX_XML:
        raise Unreadable("invalid_file", f"the {kind} file's XML unpacks to more than {MAX_XML // 2**20} MiB")
    try:
        return read(io.BytesIO(content))
    except Exception as exc:  # noqa: BLE001 - a malformed part trips the library in many ways: the file's fault
        raise Unreadable("invalid_file", f"the {kind} file cannot be read ({type(exc).__name__})") from None


def _xml_typed(content: bytes, parts: list[zipfile.ZipInfo]) -> list[zipfile.ZipInfo]:
    """The parts the libraries may parse as XML: those named so, and those whose content type
    (``[Content_Types].xml``: an ``Override`` by part name, else a ``Default`` by extension, both
    without regard to case, as python-docx and python-pptx look them up) is XML whatever their
    names, so that a part named ``.dat`` whose type is a document's XML is held to ``MAX_XML`` too."""
    from lxml import etree

    try:
        with zipfile.ZipFile(io.BytesIO(content)) as archive:
            types = archive.read("[Content_Types].xml")
        root = etree.fromstring(types, etree.XMLParser(resolve_entities=False, no_network=True))
    except (KeyError, zipfile.BadZipFile, EOFError, ValueError, etree.XMLSyntaxError):
        return [part for part in parts if part.filename.lower().endswith((".xml", ".rels"))]  # the library refuses it
    defaults, overrides = {}, {}
    for entry in root:
        kind, ctype = etree.QName(entry).localname if isinstance(entry.tag, str) else "", entry.get("ContentType", "")
        if kind == "Default":
            defaults[entry.get("Extension", "").lower()] = ctype
        elif kind == "Override":
            overrides[entry.get("PartName", "").lower()] = ctype

    def xml(name: str) -> bool:
        leaf = name.rsplit("/", 1)[-1]
        extension = leaf.rsplit(".", 1)[-1].lower() if "." in leaf else ""
        ctype = overrides.get("/" + name.lower()) or defaults.get(extension)
        return name.lower().endswith((".xml", ".rels")) or (ctype or "").lower().endswith("xml")
    return [part for part in parts if xml(part.filename)]


def _docx(stream: io.BytesIO) -> str:
    import docx
    from docx.table import Table

    lines = []
    for block in docx.Document(stream).iter_inner_content():
        if isinstance(block, Table):
            rows = _rows(block)
            if rows:
                lines.append("\n".join(rows))
            continue
        text = block.text.strip()
        if text:
            level = _heading_level(block.style.name if block.style is not None else "")
            lines.append(f"{'#' * level} {text}" if level else text)
    return "\n\n".join(lines)


def _heading_level(style: str) -> int:
    if style == "Title":
        return 1
    match = re.fullmatch(r"Heading ([1-9])", style)
    return int(match.group(1)) if match else 0


def _rows(table) -> list[str]:
    """A Word or PowerPoint table a row per line; a merged cell once (both libraries repeat it)."""
    out = []
    for row in table.rows:
        seen, cells = set(), []
        for cell in row.cells:
            if id(cell._tc) not in seen:
                seen.add(id(cell._tc))
                cells.append(" ".join(cell.text.split()))
        if any(cells):
            out.append(" | ".join(cells))
    return out


def _pptx(stream: io.BytesIO) -> str:
    import pptx

    slides = []
    for number, slide in enumerate(pptx.Presentation(stream).slides, 1):
        lines = [f"## Slide {number}"] + _shapes(slide.shapes)
        if slide.has_notes_slide and slide.notes_slide.notes_text_frame is not None:
            notes = slide.notes_slide.notes_text_frame.text.strip()
            if notes:
                lines.append(f"Notes: {notes}")
        slides.append("\n".join(lines))
    return "\n\n".join(slides)


def _shapes(shapes) -> list[str]:
    from pptx.shapes.group import GroupShape

    lines = []
    for shape in shapes:
        if isinstance(shape, GroupShape):
            lines += _shapes(shape.shapes)
        elif getattr(shape, "has_table", False) and shape.has_table:
            lines += _rows(shape.table)
        elif shape.has_text_frame:
            lines += [p for p in (" ".join(par.text.split()) for par in shape.text_frame.paragraphs) if p]
    return lines


_BLOCKS = {"address", "article", "aside", "blockquote", "br", "dd", "details", "div", "dl", "dt", "figcaption",
           "figure", "footer", "form", "header", "hr", "li", "main", "nav", "ol", "p", "pre", "section", "summary",
           "table", "tr", "ul", "h1", "h2", "h3", "h4", "h5", "h6", "caption", "title"}
_HIDDEN = ["script", "style", "noscript", "template", "svg", "iframe", "object"]


def _html(content: bytes) -> str:
    """What a reader of the page sees: its text with lines where blocks begin (see the module)."""
    from bs4 import BeautifulSoup

    if content.count(b"<") > MAX_HTML_TAGS:  # (a '<' in a script or a comment counts too: an upper bound)
        raise Unreadable("invalid_file", f"the HTML page has more than {MAX_HTML_TAGS:,} tags")
    soup = BeautifulSoup(content, "html.parser")  # bytes: it finds the encoding (BOM, <meta charset>, guess)
    lines = (" ".join(line.split()).removesuffix(" |") for line in "".join(_seen(soup)).splitlines())
    return "\n".join(line for line in lines if line.strip("#-| "))  # not a heading, item or row left empty


def _seen(soup) -> list[str]:
    """The page's text as its reader sees it, in pieces: its strings (as ``get_text`` takes them:
    no comments, scripts or styles), none of a hidden element's, a line begun before each block
    (a heading's ``#``, a list item's ``- ``) and ended after it, a cell followed by `` | ``. One
    walk over the tree: marks inserted into the tree cost a search of their parent's children
    each, quadratic in a page of many paragraphs (300 KiB of them: 110 s)."""
    from bs4.element import Tag

    strings = soup.interesting_string_types
    parts: list[str] = []
    walks, ends = [iter(soup.contents)], [""]
    while walks:
        node = next(walks[-1], None)
        if node is None:
            walks.pop()
            parts.append(ends.pop())
        elif isinstance(node, Tag):
            if node.name in _HIDDEN:
                continue
            if node.name in ("td", "th"):
                end = " | "
            elif node.name in _BLOCKS:
                parts.append("\n" + ("#" * int(node.name[1]) + " " if re.fullmatch(r"h[1-6]", node.name) else
                                     "- " if node.name == "li" else ""))
                end = "\n"
            else:
                end = ""
            walks.append(iter(node.contents))
            ends.append(end)
        elif type(node) in strings:
            parts.append(str(node))
    return parts
