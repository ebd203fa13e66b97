"""Quality and performance suites that write JSON + PNG reports."""
