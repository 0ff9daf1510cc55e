module strata.dev/pause

go 1.22
