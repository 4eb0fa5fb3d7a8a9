"""What goes in: an input read row by row, the rows a job takes, and a row made a prompt."""
