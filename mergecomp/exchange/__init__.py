"""One merged group's trip between the ranks: its check, error compensation and hand-over
(:mod:`.exchange`), the encode and decode around its collectives (:mod:`.encoder`), the scheme
that moves it (:mod:`.schemes`), the group in flight (:mod:`.job`); merge plans and their layout
(:mod:`.plan`), where a step's time goes (:mod:`.breakdown`)."""
