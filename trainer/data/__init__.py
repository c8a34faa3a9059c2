"""Training data: from documents to token rows.

- ``dataset``: read JSONL/TSV, split deterministically, tokenize, pack or split long documents,
  collate; instruction records mask the prompt out of the loss.
- ``length_report``: token lengths of the training file and what each way of fitting them costs
  (``python -m trainer preprocess``).
- ``corpus``: a folder of PDF/DOCX/Markdown/text documents as JSONL records (``prepare-corpus``).

Nothing is imported here, so ``corpus`` stays free of torch.
"""
