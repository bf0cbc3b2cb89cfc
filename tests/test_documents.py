"""gateway.documents: the text vector stores read from Word, PowerPoint, HTML, PDF and UTF-8 files,
each made here by the library that writes that format (python-docx, python-pptx, pypdf), and the
files it refuses with OpenAI's ``last_error`` codes: other Office formats, archives, the old
binary formats, broken or oversized Office files, and an Office file whose XML asks for an
external entity (never read)."""

from __future__ import annotations

import io
import zipfile

import docx
import pptx
import pytest
from pptx.util import Inches

from gateway import documents
from gateway.documents import Unreadable, document_text


def word_file() -> bytes:
    d = docx.Document()
    d.add_heading("Refund policy", level=1)
    d.add_paragraph("Paid requests are refunded within 30 days.")
    table = d.add_table(rows=2, cols=3)
    for i, row in enumerate([["tier", "refund", "days"], ["paid", "yes", "30"]]):
        for j, value in enumerate(row):
            table.cell(i, j).text = value
    table.cell(0, 1).merge(table.cell(0, 2))  # one cell over two columns: python-docx returns it twice
    d.add_paragraph("   ")  # an empty paragraph leaves no line
    d.add_heading("Batch", level=2)
    d.add_paragraph("Batch work yields.")
    out = io.BytesIO()
    d.save(out)
    return out.getvalue()


def slides_file() -> bytes:
    p = pptx.Presentation()
    first = p.slides.add_slide(p.slide_layouts[1])
    first.shapes.title.text = "Tiers"
    first.placeholders[1].text = "Paid first\nBatch last"
    first.notes_slide.notes_text_frame.text = "Say it slowly."
    second = p.slides.add_slide(p.slide_layouts[5])
    second.shapes.title.text = "Table"
    table = second.shapes.add_table(2, 2, Inches(1), Inches(1), Inches(4), Inches(2)).table
    for (i, j), value in zip([(0, 0), (0, 1), (1, 0), (1, 1)], "abcd"):
        table.cell(i, j).text = value
    group = second.shapes.add_group_shape()
    group.shapes.add_textbox(Inches(1), Inches(4), Inches(2), Inches(1)).text_frame.text = "in a group"
    out = io.BytesIO()
    p.save(out)
    return out.getvalue()


PAGE = """<!DOCTYPE html><html><head><meta charset="iso-8859-1"><title>Caf\xe9</title>
<style>p { color: red }</style><script>var secret = "never read";</script></head>
<body><h1>Refunds</h1><p>Paid <b>requests</b> are   refunded.</p><ul><li>one</li><li>two</li></ul>
<table><tr><th>tier</th><th>days</th></tr><tr><td>paid</td><td>30</td></tr></table>
<div>na\xefve<br>line</div><h2></h2><noscript>enable scripts</noscript></body></html>""".encode("latin-1")


def test_a_word_file_is_its_headings_paragraphs_and_tables_in_order():
    assert document_text(word_file(), "policy.docx") == (
        "# Refund policy\n\nPaid requests are refunded within 30 days.\n\n"
        "tier | refund days\npaid | yes | 30\n\n## Batch\n\nBatch work yields.")


def test_a_presentation_is_its_slides_shapes_tables_groups_and_notes():
    assert document_text(slides_file(), "deck.pptx") == (
        "## Slide 1\nTiers\nPaid first\nBatch last\nNotes: Say it slowly.\n\n"
        "## Slide 2\nTable\na | b\nc | d\nin a group")


@pytest.mark.parametrize("name", ["page.html", "PAGE.HTM", "page.bin", ""])
def test_html_is_the_text_a_reader_sees_in_its_own_encoding(name):
    """By its name, or by its first bytes whatever the name: no markup, script, style or noscript
    text; the <meta charset> decodes it; blocks begin lines."""
    assert document_text(PAGE, name) == "Café\n# Refunds\nPaid requests are refunded.\n- one\n- two\ntier | days\npaid | 30\nnaïve\nline"


def test_a_long_page_is_read_in_one_walk_without_changing_its_tree(monkeypatch):
    """A page of many sibling paragraphs: marking each block by inserting into the tree searched
    its parent's children each time, quadratic (30,000 paragraphs, 230 KiB: ~60 s of the indexer; a
    3 MB page: hours). The page is read in one walk that inserts nothing (its cost is linear: the
    figures are in hunt JJ's report, not timed here)."""
    from bs4.element import PageElement

    def inserted(self, *args):
        raise AssertionError("the page's tree was changed while it was read")

    monkeypatch.setattr(PageElement, "insert_before", inserted)
    monkeypatch.setattr(PageElement, "insert_after", inserted)
    page = ("<html><body>" + "<p>x</p>" * 3_000 + "<ul><li>a</li></ul><h2>b</h2></body></html>").encode()
    assert document_text(page, "long.html") == "\n".join(["x"] * 3_000 + ["- a", "## b"])


def test_text_that_is_not_html_stays_as_written():
    for content, name in ((b"\xef\xbb\xbf# Notes\n<html> is a tag\n", "notes.md"), (b'{"html": "<p>x</p>"}', "a.json")):
        assert document_text(content, name) == content.decode("utf-8-sig")
    # an HTML page's name reads it as HTML even when it does not open like one
    assert document_text(b"<p>Hello <i>there</i></p>", "frag.html") == "Hello there"


def test_a_pdf_is_its_pages_text():
    from tests.helpers import tiny_pdf

    assert document_text(tiny_pdf(["first page", "second page"]), "a.pdf") == "first page\n\nsecond page"


def _zip(parts: dict[str, bytes], compression=zipfile.ZIP_DEFLATED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as archive:
        for name, data in parts.items():
            archive.writestr(name, data)
    return out.getvalue()


@pytest.mark.parametrize("content, code, says", [
    (_zip({"[Content_Types].xml": b"<Types/>", "xl/workbook.xml": b"<workbook/>"}), "unsupported_file", "Excel"),
    (_zip({"mimetype": b"application/vnd.oasis.opendocument.text", "content.xml": b"<x/>"}), "unsupported_file",
     "OpenDocument"),
    (_zip({"notes.txt": b"hello"}), "unsupported_file", "ZIP archive"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + b"\x00" * 500, "unsupported_file", ".docx or .pptx"),
    (b"PK\x03\x04 cut short", "invalid_file", "cannot be opened"),
    (_zip({"[Content_Types].xml": b"<Types/>", "word/document.xml": b"<not closed"}), "invalid_file",
     "Word file cannot be read"),
    (b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01", "unsupported_file", "not a PDF, a Word or PowerPoint file"),
])
def test_what_is_not_read_says_why(content, code, says):
    with pytest.raises(Unreadable) as refused:
        document_text(content, "upload.bin")
    assert refused.value.code == code and says in refused.value.message, refused.value.message


@pytest.mark.parametrize("limit, counted, says", [
    ("MAX_UNPACKED", (), "file unpacks to more than"),
    ("MAX_XML", (".xml", ".rels"), "XML unpacks to more than")])
def test_an_office_file_that_unpacks_too_large_is_refused_before_it_is_parsed(monkeypatch, limit, counted, says):
    """The check reads the archive's directory: a part declared larger than the limit is never
    handed to the library (here one that would parse fine). Its XML parts are counted apart too (a
    tree costs ~35 bytes a byte of XML: 256 MiB of it took ~9 GB)."""
    content = word_file()
    unpacked = sum(p.file_size for p in zipfile.ZipFile(io.BytesIO(content)).infolist()
                   if not counted or p.filename.endswith(counted))
    monkeypatch.setattr(documents, limit, unpacked - 1)
    with pytest.raises(Unreadable) as refused:
        document_text(content, "big.docx")
    assert refused.value.code == "invalid_file" and says in refused.value.message, refused.value.message
    monkeypatch.setattr(documents, limit, unpacked)
    assert "Refund policy" in document_text(content, "big.docx")


def test_an_html_page_of_too_many_tags_is_refused_before_it_is_parsed(monkeypatch):
    """Beautiful Soup spends ~20 us and ~1 KiB an element: a 25 MiB page of empty elements took ~40 s
    and ~2 GB. Its tags are counted first (each '<'), and past ``MAX_HTML_TAGS`` the page is never
    parsed."""
    import bs4

    page = b"<html><body>" + b"<p>word</p>" * 50 + b"</body></html>"
    tags = page.count(b"<")
    monkeypatch.setattr(documents, "MAX_HTML_TAGS", tags - 1)
    parse = bs4.BeautifulSoup
    monkeypatch.setattr(bs4, "BeautifulSoup", lambda *a, **k: pytest.fail("the page was parsed"))
    with pytest.raises(Unreadable) as refused:
        document_text(page, "page.html")
    assert refused.value.code == "invalid_file" and f"{tags - 1:,} tags" in refused.value.message
    monkeypatch.setattr(bs4, "BeautifulSoup", parse)
    monkeypatch.setattr(documents, "MAX_HTML_TAGS", tags)
    assert "word" in document_text(page, "page.html")


def test_an_office_part_whose_content_type_is_xml_counts_as_xml_whatever_its_name(monkeypatch):
    """python-docx parses a part by the content type [Content_Types].xml gives it, not by its name:
    a styles part named ``big.dat`` is parsed as XML, so it counts against ``MAX_XML`` (it did not:
    a 0.2 MiB upload with 48 MiB of XML so named was parsed, past the 32 MiB cap)."""
    source = zipfile.ZipFile(io.BytesIO(word_file()))
    big = (b'<w:styles xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main">'
           + b'<w:style w:type="paragraph" w:styleId="s"/>' * 2000 + b"</w:styles>")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for info in source.infolist():
            data = source.read(info.filename)
            if info.filename == "[Content_Types].xml":
                data = data.replace(b"<Default ", b'<Default Extension="DAT" ContentType="application/vnd.'
                                    b'openxmlformats-officedocument.wordprocessingml.styles+xml"/><Default ', 1)
            elif info.filename == "word/_rels/document.xml.rels":
                data = data.replace(b"</Relationships>", b'<Relationship Id="rIdBig" Type="http://schemas.'
                                    b'openxmlformats.org/officeDocument/2006/relationships/customXml" '
                                    b'Target="big.dat"/></Relationships>')
            z.writestr(info.filename, data)
        z.writestr("word/big.dat", big)
    content = out.getvalue()
    named = sum(p.file_size for p in zipfile.ZipFile(io.BytesIO(content)).infolist()
                if p.filename.endswith((".xml", ".rels")))
    monkeypatch.setattr(documents, "MAX_XML", named + len(big) - 1)
    with pytest.raises(Unreadable) as refused:
        document_text(content, "big.docx")
    assert refused.value.code == "invalid_file" and "XML unpacks to more than" in refused.value.message
    monkeypatch.setattr(documents, "MAX_XML", named + len(big))
    assert "Refund policy" in document_text(content, "big.docx")


def test_a_pdf_whose_text_grows_past_the_limit_is_refused(monkeypatch):
    """Pages may share one content stream, so a small PDF can hold its text many times: reading
    stops once the pages' text passes ``MAX_TEXT_CHARS``."""
    from tests.helpers import tiny_pdf

    pdf = tiny_pdf(["first page", "second page"])
    monkeypatch.setattr(documents, "MAX_TEXT_CHARS", len("first page") + 3)
    with pytest.raises(Unreadable) as refused:
        document_text(pdf, "a.pdf")
    assert refused.value.code == "invalid_file" and "longer than" in refused.value.message
    monkeypatch.setattr(documents, "MAX_TEXT_CHARS", len("first page") + len("second page"))
    assert document_text(pdf, "a.pdf") == "first page\n\nsecond page"


def test_an_external_entity_in_an_office_file_is_never_read(tmp_path):
    """XXE: a document.xml that declares an entity for a file on the server. The libraries' parser
    does not resolve it, so the file's text never reaches a chunk."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-VALUE")
    with zipfile.ZipFile(io.BytesIO(word_file())) as archive:
        parts = {info.filename: archive.read(info) for info in archive.infolist()}
    xml = parts["word/document.xml"].decode()
    declaration = f'<!DOCTYPE w:document [<!ENTITY leak SYSTEM "file://{secret}">]>'
    xml = xml.replace("?>", "?>" + declaration, 1).replace("Batch work yields.", "Batch work yields. &leak;")
    parts["word/document.xml"] = xml.encode()
    from lxml import etree  # the attack works on a parser that resolves entities: the test can fail

    assert "TOP-SECRET-VALUE" in etree.tostring(etree.fromstring(xml.encode(), etree.XMLParser(resolve_entities=True)),
                                               encoding="unicode")
    try:
        text = document_text(_zip(parts), "leak.docx")
    except Unreadable as refused:  # refusing the entity outright is as good
        assert refused.code == "invalid_file"
        return
    assert "TOP-SECRET-VALUE" not in text and "Batch work yields." in text
